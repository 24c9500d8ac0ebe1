//! Compares Kiln's CPU forward with the reference outputs of `bench/reference/smollm2-q4_1/`
//! (llama.cpp through llama-cpp-python, and a float64 numpy forward): for each prompt, the
//! greedy continuation of 64 tokens, where the two part, the reference's top-2 margin there, and
//! the largest first-step logit difference against each reference.
//!
//! `cargo run --release -p kiln-engine --example compare_reference -- MODEL.gguf bench/reference/smollm2-q4_1`

use std::path::PathBuf;

use kiln_engine::models::load_path;

fn read_f32(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn main() -> kiln_core::Result<()> {
    let mut args = std::env::args().skip(1);
    let model_path = PathBuf::from(args.next().expect("usage: compare_reference MODEL REFERENCE_DIR"));
    let dir = PathBuf::from(args.next().expect("usage: compare_reference MODEL REFERENCE_DIR"));
    let text =
        std::fs::read_to_string(dir.join("llamacpp.json")).map_err(|e| kiln_core::Error::io(&dir, e))?;
    let reference: serde_json::Value = serde_json::from_str(&text).expect("reference JSON");
    let (model, _) = load_path(&model_path)?;
    let vocab = model.config().vocab;
    let llamacpp = read_f32(&dir.join("first_logits_llamacpp.f32"));
    let numpy = read_f32(&dir.join("first_logits_numpy.f32"));
    let steps = reference["n_steps"].as_u64().unwrap_or(64) as usize;

    println!("| prompt | max abs diff vs llama.cpp (step 1) | vs numpy f64 | identical greedy tokens | parts at step | llama.cpp top-2 margin there | Kiln top-2 margin there |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let prompts = reference["prompts"].as_array().expect("prompts");
    for (p, prompt) in prompts.iter().enumerate() {
        let ids: Vec<u32> = prompt["prompt_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().unwrap_or(0) as u32)
            .collect();
        let want: Vec<u32> = prompt["generated_ids"]
            .as_array()
            .expect("generated")
            .iter()
            .map(|v| v.as_u64().unwrap_or(0) as u32)
            .collect();
        let mut cache = model.new_cache(ids.len() + steps + 1)?;
        let mut logits = model.forward(&ids, &mut cache)?;
        let row = |all: &[f32]| all[p * vocab..(p + 1) * vocab].to_vec();
        let max_diff =
            |other: &[f32]| logits.iter().zip(other).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let (diff_llamacpp, diff_numpy) = (max_diff(&row(&llamacpp)), max_diff(&row(&numpy)));
        let mut parted = None;
        let mut kiln_margin = f32::NAN;
        for (step, &expected) in want.iter().enumerate().take(steps) {
            let token = kiln_core::ops::sample::argmax(&logits).unwrap_or(u32::MAX);
            if token != expected {
                let mut sorted = logits.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                kiln_margin = sorted[0] - sorted[1];
                parted = Some(step);
                break;
            }
            logits = model.forward(&[token], &mut cache)?;
        }
        let name = prompt["name"].as_str().unwrap_or("?");
        match parted {
            None => println!("| {name} | {diff_llamacpp:.3} | {diff_numpy:.1e} | {steps} | never | – | – |"),
            Some(step) => {
                let top2 = &prompt["top2_logits"][step];
                let margin = top2[0].as_f64().unwrap_or(f64::NAN) - top2[1].as_f64().unwrap_or(f64::NAN);
                println!(
                    "| {name} | {diff_llamacpp:.3} | {diff_numpy:.1e} | {step} | {step} | {margin:.3} | {kiln_margin:.3} |"
                );
            }
        }
    }
    Ok(())
}
