//! Prints Kiln's CPU logits for a token sequence, as JSON, for comparison with another
//! implementation (`bench/peers/hf_tiny_reference.py` compares them with transformers').
//!
//! `hf_logits [--cuda] MODEL PREFIX_LEN ID ID ...`: runs the first PREFIX_LEN ids as one prefill,
//! then each remaining id as a decode step, and prints `{"logits": [[...], ...]}`: the logits
//! after the prefill and after every decode step. `--cuda` runs the GPU engine instead of the CPU.

use kiln_engine::models::load_model;

fn main() -> kiln_core::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let cuda = args.first().is_some_and(|a| a == "--cuda");
    if cuda {
        args.remove(0);
    }
    let usage = || kiln_core::Error::InvalidArgument {
        name: "arguments",
        value: args.join(" "),
        reason: "usage: hf_logits [--cuda] MODEL PREFIX_LEN ID ID ...".into(),
    };
    let model_path = args.first().ok_or_else(usage)?;
    let prefix: usize = args.get(1).and_then(|v| v.parse().ok()).ok_or_else(usage)?;
    let ids: Vec<u32> = args[2..].iter().map(|v| v.parse().map_err(|_| usage())).collect::<Result<_, _>>()?;
    if prefix == 0 || prefix > ids.len() {
        return Err(usage());
    }
    let model = load_model(std::path::Path::new(model_path))?;
    let rows = if cuda {
        use kiln_engine::models::gpu::{GpuEngine, GpuOptions};
        let options = GpuOptions { max_context: ids.len() + 1, ..GpuOptions::default() };
        let mut engine = GpuEngine::new(kiln_cuda::Gpu::open(0)?, &model, options)?;
        let params = kiln_core::ops::sample::SamplingParams { temperature: 0.0, ..Default::default() };
        let mut seq = engine.new_sequence(params)?;
        let mut rows = vec![engine.step_with_logits(&mut [(&mut seq, &ids[..prefix])])?.1.remove(0)];
        for &id in &ids[prefix..] {
            rows.push(engine.step_with_logits(&mut [(&mut seq, &[id])])?.1.remove(0));
        }
        rows
    } else {
        let mut cache = model.new_cache(ids.len())?;
        let mut rows = vec![model.forward(&ids[..prefix], &mut cache)?];
        for &id in &ids[prefix..] {
            rows.push(model.forward(&[id], &mut cache)?);
        }
        rows
    };
    let json =
        serde_json::json!({ "architecture": format!("{:?}", model.config().architecture), "logits": rows });
    println!("{json}");
    Ok(())
}
