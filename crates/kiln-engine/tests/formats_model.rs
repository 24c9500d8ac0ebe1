//! The real default model, read by Kiln and compared with what llama.cpp's `gguf` Python package
//! read from the same file (`fixtures/smollm2_q4_1.json`, written by
//! `fixtures/make_model_fixture.py`).
//!
//! Ignored by default (CI has no model file): run with `KILN_TEST_MODEL` naming
//! SmolLM2-135M-Instruct.Q4_1.gguf and `cargo test -p kiln-engine --test formats_model --
//! --include-ignored`; unset or naming a missing file, it fails.

use std::path::PathBuf;

use kiln_core::DType;
use kiln_engine::formats::{dequantize_row, dot_row, GgufFile, WeightSource};
use sha2::{Digest, Sha256};

fn model_path() -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os("KILN_TEST_MODEL").expect("KILN_TEST_MODEL is not set"));
    assert!(path.is_file(), "KILN_TEST_MODEL={} does not name a file", path.display());
    Some(path)
}

fn expected() -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2_q4_1.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
#[ignore = "needs KILN_TEST_MODEL (SmolLM2-135M-Instruct.Q4_1.gguf)"]
fn smollm2_reads_as_the_gguf_package_reads_it() {
    let Some(path) = model_path() else { return };
    let want = expected();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.tensor_infos().len() as u64, want["tensor_count"].as_u64().unwrap());
    assert_eq!(file.metadata_len() as u64, want["metadata_count"].as_u64().unwrap());
    assert_eq!(u64::from(file.get_u32("llama.block_count").unwrap()), want["block_count"].as_u64().unwrap());
    assert_eq!(
        f64::from(file.get_f32("llama.rope.freq_base").unwrap()),
        want["rope_freq_base"].as_f64().unwrap()
    );
    assert_eq!(file.get_str("tokenizer.ggml.pre").unwrap(), want["pre"].as_str().unwrap());
    let tokens = want["token_count"].as_u64().unwrap() as usize;
    assert_eq!(file.get_string_array("tokenizer.ggml.tokens").unwrap().len(), tokens);
    assert_eq!(file.get_i32_array("tokenizer.ggml.token_type").unwrap().len(), tokens);

    let mut dtypes: Vec<DType> = file.tensor_infos().iter().map(|t| t.dtype).collect();
    dtypes.sort();
    dtypes.dedup();
    assert_eq!(dtypes, vec![DType::F32, DType::Q4_1, DType::Q8_0]);

    for t in want["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let info = file.tensor_info(name).unwrap();
        assert_eq!(info.dtype.name(), t["dtype"].as_str().unwrap(), "{name}");
        let dims: Vec<u64> = t["dims"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        assert_eq!(info.dims, dims, "{name}");
        let shape = file.weight_info(name).unwrap().shape;
        assert_eq!(shape, dims.iter().rev().map(|&d| d as usize).collect::<Vec<_>>(), "{name}");

        let mut values = vec![f32::NAN; info.elements() as usize];
        dequantize_row(info.dtype, file.tensor_bytes(name).unwrap(), &mut values).unwrap();
        // Compared as f32: the JSON text holds each f32 exactly, narrowing undoes parsing's last bit.
        let first: Vec<f32> =
            t["first"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(&values[..first.len()], &first[..], "{name}");
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let digest: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(digest, t["sha256_f32"].as_str().unwrap(), "{name}: dequantized values differ");

        // A row's block-wise dot equals the float64 dot of its dequantized values.
        let cols = dims[0] as usize;
        let row_bytes = info.dtype.bytes_for(cols as u64).unwrap() as usize;
        let x: Vec<f32> = (0..cols).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let got = dot_row(info.dtype, &file.tensor_bytes(name).unwrap()[..row_bytes], &x).unwrap();
        let reference: f64 = values[..cols].iter().zip(&x).map(|(&w, &v)| f64::from(w) * f64::from(v)).sum();
        assert!((f64::from(got) - reference).abs() < 1e-4, "{name}: dot_row {got} vs {reference}");
    }

    // Every tensor's bytes are in the file and its copy has the row-major shape.
    for info in file.tensor_infos() {
        let tensor = file.tensor(&info.name).unwrap();
        assert_eq!(tensor.host_bytes().unwrap().len() as u64, info.bytes, "{}", info.name);
        assert_eq!(tensor.shape().iter().rev().map(|&d| d as u64).collect::<Vec<_>>(), info.dims);
    }
}
