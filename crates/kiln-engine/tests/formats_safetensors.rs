//! safetensors files: what must load, and the malformed files Kiln refuses on top of the
//! `safetensors` crate's own checks, each with its named reason.

use std::path::{Path, PathBuf};

use kiln_core::{DType, Error};
use kiln_engine::formats::{HfConfig, SafetensorsFile, SafetensorsWeights, WeightSource};

/// A file from a header text and data bytes, the header padded with `pad` spaces.
fn file_bytes(header: &str, pad: usize, data: &[u8]) -> Vec<u8> {
    let header = format!("{header}{}", " ".repeat(pad));
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(data);
    v
}

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-st-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn reason(result: Result<impl std::fmt::Debug, Error>) -> String {
    match result {
        Err(Error::Safetensors { reason, .. }) => reason,
        other => panic!("expected a safetensors error, got {other:?}"),
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[test]
fn edge_cases_load_and_unaligned_data_is_copied() {
    let d = dir("edges");
    // Rank 0, zero-sized, NaN and Inf; the header padded to put the data at an odd offset.
    let data = f32_bytes(&[f32::NAN, f32::INFINITY, -0.0, 2.5]);
    let header = r#"{"__metadata__":{"format":"pt"},"scalar":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"empty":{"dtype":"BF16","shape":[0,3],"data_offsets":[4,4]},"v":{"dtype":"F32","shape":[3],"data_offsets":[4,16]}}"#;
    let pad = (0..8).find(|p| (8 + header.len() + p) % 4 == 1).unwrap();
    let path = write(&d, "m.safetensors", &file_bytes(header, pad, &data));
    let file = SafetensorsFile::open(&path).unwrap();
    assert_eq!(file.metadata().get("format").map(String::as_str), Some("pt"));
    let v = file.tensor_bytes("v").unwrap();
    assert_eq!(v.as_ptr() as usize % 4, 1, "the test means to exercise unaligned data");
    let t = file.tensor("v").unwrap();
    let values = t.to_f32_vec().unwrap();
    assert!(values[0].is_infinite() && values[1] == 0.0 && values[1].is_sign_negative() && values[2] == 2.5);
    assert!(file.tensor("scalar").unwrap().to_f32_vec().unwrap()[0].is_nan());
    assert_eq!(file.tensor("scalar").unwrap().shape(), &[] as &[usize]);
    let empty = file.weight_info("empty").unwrap();
    assert_eq!((empty.shape, empty.dtype), (vec![0, 3], DType::BF16));
    assert_eq!(file.tensor("empty").unwrap().elements(), 0);
    assert!(matches!(file.tensor("nope"), Err(Error::MissingTensor { .. })));
}

#[test]
fn malformed_files_get_named_errors() {
    let d = dir("malformed");
    let ok_tensor = r#""a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#;
    let data = f32_bytes(&[1.0, 2.0]);
    let mut huge = 200_000_000u64.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    let mut past_end = 64u64.to_le_bytes().to_vec();
    past_end.extend_from_slice(b"{}");
    let mut not_utf8 = 4u64.to_le_bytes().to_vec();
    not_utf8.extend_from_slice(&[b'{', 0xff, 0xfe, b'}']);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("short", vec![1, 0, 0], "too small"),
        ("header_over_100mb", huge, "too large"),
        ("header_past_end", past_end, "header length"),
        ("not_utf8", not_utf8, "UTF-8"),
        ("not_json", file_bytes("{not json", 0, &data), "invalid JSON"),
        (
            "duplicate_identical",
            file_bytes(&format!("{{{ok_tensor},{ok_tensor}}}"), 0, &data),
            "tensor name `a` appears twice",
        ),
        (
            "overlap",
            file_bytes(
                &format!(r#"{{{ok_tensor},"b":{{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}}}"#),
                0,
                &data,
            ),
            "invalid offset",
        ),
        (
            "gap",
            file_bytes(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#, 0, &data),
            "invalid offset",
        ),
        (
            "bytes_after_last_tensor",
            file_bytes(&format!("{{{ok_tensor}}}"), 0, &f32_bytes(&[1.0, 2.0, 3.0])),
            "incomplete metadata",
        ),
        (
            "shape_disagrees_with_range",
            file_bytes(r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 0, &data),
            "invalid shape, data type, or offset",
        ),
        (
            "dtype_not_in_table",
            file_bytes(r#"{"a":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[0,3]}}"#, 0, &data[..3]),
            "dtype F6_E2M3 is not in Kiln's table",
        ),
    ];
    for (name, bytes, want) in cases {
        let path = write(&d, &format!("{name}.safetensors"), &bytes);
        let got = reason(SafetensorsFile::open(&path));
        assert!(got.contains(want), "case {name}: reason `{got}` does not say `{want}`");
        assert!(SafetensorsFile::check_bytes(&bytes).is_err(), "case {name} from bytes");
    }
}

#[test]
fn truncation_at_every_byte_is_an_error() {
    let data = f32_bytes(&[1.0, 2.0, 3.0]);
    let bytes = file_bytes(
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#,
        0,
        &data,
    );
    assert_eq!(SafetensorsFile::check_bytes(&bytes).unwrap().len(), 2);
    for len in 0..bytes.len() {
        assert!(SafetensorsFile::check_bytes(&bytes[..len]).is_err(), "truncated to {len}");
    }
}

#[test]
fn sharded_checkpoints_load_through_the_index() {
    let d = dir("sharded");
    write(
        &d,
        "s1.safetensors",
        &file_bytes(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#, 0, &f32_bytes(&[1.0])),
    );
    write(
        &d,
        "s2.safetensors",
        &file_bytes(r#"{"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#, 0, &f32_bytes(&[2.0])),
    );
    write(
        &d,
        "model.safetensors.index.json",
        br#"{"metadata":{},"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}}"#,
    );
    let w = SafetensorsWeights::open(&d).unwrap();
    assert_eq!(w.tensor_names(), ["a", "b"]);
    assert_eq!(w.tensor("b").unwrap().to_f32_vec().unwrap(), [2.0]);
    assert_eq!(w.shards().len(), 2);

    let index = |text: &str| {
        let p = write(&d, "bad.index.json", text.as_bytes());
        reason(SafetensorsWeights::open(&p))
    };
    assert!(index(r#"{"weight_map":{"a":"s2.safetensors"}}"#).contains("does not hold it"));
    assert!(index(r#"{"weight_map":{"a":"../s1.safetensors"}}"#).contains("not a file name"));
    assert!(index(r#"{"weight_map":{}}"#).contains("empty"));
    assert!(index(r#"{"weight_map":"#).contains("index"));
    write(
        &d,
        "s3.safetensors",
        &file_bytes(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#, 0, &f32_bytes(&[3.0])),
    );
    assert!(index(r#"{"weight_map":{"a":"s1.safetensors","z":"s3.safetensors"}}"#).contains("does not hold"));
    let twice = r#"{"weight_map":{"a":"s1.safetensors","b":"s2.safetensors","c":"s3.safetensors"}}"#;
    assert!(index(twice).contains("does not hold"));
}

#[test]
fn hf_config_reads_llama_fields() {
    let text = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,"intermediate_size":1536,
        "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"rms_norm_eps":1e-05,
        "rope_theta":100000,"rope_scaling":null,"vocab_size":49152,"tie_word_embeddings":true,
        "max_position_embeddings":8192,"torch_dtype":"bfloat16","model_type":"llama"}"#;
    let c = HfConfig::from_json(text).unwrap();
    assert_eq!(c.architecture().unwrap(), "LlamaForCausalLM");
    assert_eq!((c.hidden_size, c.num_key_value_heads, c.head_dim), (576, Some(3), None));
    assert_eq!(c.rope_theta, Some(100000.0));
    assert_eq!(c.tie_word_embeddings, Some(true));
    assert_eq!(c.torch_dtype.as_deref(), Some("bfloat16"));
    let missing = HfConfig::from_json(r#"{"architectures":[]}"#).unwrap_err();
    assert!(
        matches!(missing, Error::Model { ref reason, .. } if reason.contains("hidden_size")),
        "{missing}"
    );
    let c = HfConfig::from_json(&text.replace(r#"["LlamaForCausalLM"]"#, "[]")).unwrap();
    assert!(matches!(c.architecture(), Err(Error::Model { .. })));
}
