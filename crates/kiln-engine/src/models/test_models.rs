//! Tiny random models written as Hugging Face folders, for tests of the forward passes (CPU and
//! GPU) that need a real model file but no download.

use std::path::{Path, PathBuf};

use kiln_core::{Error, Result};

/// The shape and family of a tiny model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TinySpec {
    /// `LlamaForCausalLM`, `Qwen2ForCausalLM` (q/k/v bias) or `Qwen3ForCausalLM` (q/k norm).
    pub architecture: &'static str,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub layers: usize,
    pub tied: bool,
}

impl TinySpec {
    /// Two Llama layers of hidden 256, 4 heads of 64 over 2 KV heads, vocabulary 300.
    pub fn llama() -> TinySpec {
        TinySpec {
            architecture: "LlamaForCausalLM",
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            ffn: 512,
            vocab: 300,
            layers: 2,
            tied: false,
        }
    }
}

/// A generator of small pseudo-random values (xorshift), the same for the same seed.
pub(crate) struct Values(u64);

impl Values {
    /// Seeded from the clock (each run new values; the seed is printed): the unit tests' inputs.
    #[cfg(test)]
    pub(crate) fn from_clock() -> Values {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64 | 1)
            .unwrap_or(1);
        println!("seed {seed:#x}");
        Values(seed)
    }

    /// The next 64 raw bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// The next value, uniform in [-1, 1).
    pub(crate) fn next(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// `len` pseudo-random token ids below `vocab` (xorshift), the same for the same seed: prompts for
/// tests and benchmarks.
pub fn random_ids(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

/// Writes `spec` with weights from `seed` (bf16, scaled like a trained model's) into `dir`:
/// `config.json` and `model.safetensors`. Norm weights are near 1.
pub fn write_tiny_model(dir: &Path, spec: &TinySpec, seed: u64) -> Result<PathBuf> {
    let io = |e: std::io::Error| Error::io(dir, e);
    std::fs::create_dir_all(dir).map_err(io)?;
    let s = spec;
    let config = serde_json::json!({
        "architectures": [s.architecture], "hidden_size": s.hidden, "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "vocab_size": s.vocab, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": s.tied
    });
    std::fs::write(dir.join("config.json"), config.to_string()).map_err(io)?;
    let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let mut tensors: Vec<(String, Vec<usize>, bool)> = vec![
        ("model.embed_tokens.weight".into(), vec![s.vocab, s.hidden], false),
        ("model.norm.weight".into(), vec![s.hidden], true),
    ];
    if !s.tied {
        tensors.push(("lm_head.weight".into(), vec![s.vocab, s.hidden], false));
    }
    for l in 0..s.layers {
        let p = format!("model.layers.{l}.");
        let mut layer = vec![
            ("input_layernorm.weight", vec![s.hidden], true),
            ("post_attention_layernorm.weight", vec![s.hidden], true),
            ("self_attn.q_proj.weight", vec![q, s.hidden], false),
            ("self_attn.k_proj.weight", vec![kv, s.hidden], false),
            ("self_attn.v_proj.weight", vec![kv, s.hidden], false),
            ("self_attn.o_proj.weight", vec![s.hidden, q], false),
            ("mlp.gate_proj.weight", vec![s.ffn, s.hidden], false),
            ("mlp.up_proj.weight", vec![s.ffn, s.hidden], false),
            ("mlp.down_proj.weight", vec![s.hidden, s.ffn], false),
        ];
        if s.architecture == "Qwen2ForCausalLM" {
            layer.push(("self_attn.q_proj.bias", vec![q], false));
            layer.push(("self_attn.k_proj.bias", vec![kv], false));
            layer.push(("self_attn.v_proj.bias", vec![kv], false));
        }
        if s.architecture == "Qwen3ForCausalLM" {
            layer.push(("self_attn.q_norm.weight", vec![s.head_dim], true));
            layer.push(("self_attn.k_norm.weight", vec![s.head_dim], true));
        }
        tensors.extend(layer.into_iter().map(|(n, shape, norm)| (format!("{p}{n}"), shape, norm)));
    }
    let mut values = Values(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, shape, norm)| {
            let count: usize = shape.iter().product();
            let fan_in = *shape.last().unwrap_or(&1) as f32;
            let bytes = (0..count)
                .flat_map(|_| {
                    let v =
                        if norm { 1.0 + 0.1 * values.next() } else { values.next() * 1.7 / fan_in.sqrt() };
                    half::bf16::from_f32(v).to_le_bytes()
                })
                .collect();
            (name, shape, bytes)
        })
        .collect();
    let mut views = Vec::with_capacity(data.len());
    for (name, shape, bytes) in &data {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), bytes).map_err(
                |e| Error::InvalidArgument { name: "tiny model", value: name.clone(), reason: e.to_string() },
            )?;
        views.push((name.clone(), view));
    }
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).map_err(|e| {
        Error::InvalidArgument { name: "tiny model", value: dir.display().to_string(), reason: e.to_string() }
    })?;
    Ok(dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_models_of_each_family_load_and_run_on_the_cpu() {
        for (i, arch) in ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"].into_iter().enumerate()
        {
            let dir = std::env::temp_dir().join(format!("kiln-tiny-{}-{i}", std::process::id()));
            let spec = TinySpec { architecture: arch, tied: i == 2, ..TinySpec::llama() };
            write_tiny_model(&dir, &spec, 7).unwrap();
            let model = crate::models::load_model(&dir).unwrap();
            assert_eq!(model.config().qkv_bias, arch == "Qwen2ForCausalLM");
            assert_eq!(model.config().qk_norm, arch == "Qwen3ForCausalLM");
            let mut cache = model.new_cache(16).unwrap();
            let logits = model.forward(&[1, 2, 3], &mut cache).unwrap();
            assert_eq!(logits.len(), 300);
            assert!(logits.iter().all(|v| v.is_finite()));
            // Not a constant row: the weights are random.
            let spread = logits.iter().fold(f32::MIN, |m, v| m.max(*v))
                - logits.iter().fold(f32::MAX, |m, v| m.min(*v));
            assert!(spread > 0.1, "{arch}: {spread}");
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
