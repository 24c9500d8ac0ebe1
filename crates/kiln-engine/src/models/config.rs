//! A model's shape and hyperparameters, read from GGUF metadata or a Hugging Face `config.json`,
//! and checked before any tensor is touched.

use kiln_core::ops::rope::{RopeLayout, RopeScaling, RopeSpec};
use kiln_core::{Error, Result};

use crate::formats::GgufFile;

/// The members of the Llama family that Kiln runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2 / 3, SmolLM2, Mistral (GGUF `llama`).
    Llama,
    /// Qwen2: a bias on the q, k and v projections.
    Qwen2,
    /// Qwen3: per-head RMSNorm of q and k before RoPE.
    Qwen3,
}

impl Architecture {
    /// The architecture of a GGUF `general.architecture` or an HF `architectures[0]`.
    pub fn from_name(name: &str) -> Option<Architecture> {
        match name {
            "llama" | "mistral" | "LlamaForCausalLM" | "MistralForCausalLM" => Some(Architecture::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Some(Architecture::Qwen2),
            "qwen3" | "Qwen3ForCausalLM" => Some(Architecture::Qwen3),
            _ => None,
        }
    }
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub name: String,
    pub architecture: Architecture,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope: RopeSpec,
    pub context_length: usize,
    pub qkv_bias: bool,
    pub qk_norm: bool,
}

fn model_error(model: &str, reason: String) -> Error {
    Error::Model { model: model.to_string(), reason }
}

impl ModelConfig {
    /// Checks that the numbers make a model: nothing zero, heads that divide, sizes that fit.
    pub fn validate(&self) -> Result<()> {
        let fields = [
            ("hidden size", self.hidden),
            ("layer count", self.layers),
            ("head count", self.heads),
            ("KV head count", self.kv_heads),
            ("head size", self.head_dim),
            ("feed-forward size", self.ffn),
            ("vocabulary size", self.vocab),
        ];
        for (what, value) in fields {
            if value == 0 {
                return Err(model_error(&self.name, format!("{what} is 0")));
            }
            if value > 1 << 24 {
                return Err(model_error(&self.name, format!("{what} {value} is beyond any real model")));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(model_error(
                &self.name,
                format!("{} heads are not a multiple of {} KV heads", self.heads, self.kv_heads),
            ));
        }
        if !(self.rms_eps > 0.0 && self.rms_eps < 1.0) {
            return Err(model_error(
                &self.name,
                format!("RMSNorm epsilon {} is not in (0, 1)", self.rms_eps),
            ));
        }
        self.rope.validate(self.head_dim).map_err(|e| e.context(format!("model {}", self.name)))
    }

    /// The configuration of a GGUF file of the Llama family.
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig> {
        let arch_name = file.get_str("general.architecture")?;
        let architecture = Architecture::from_name(arch_name).ok_or_else(|| Error::NotServed {
            op: "model loading",
            reason: format!("GGUF architecture `{arch_name}` (Kiln runs llama, qwen2, qwen3)"),
        })?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let name = file.opt_str("general.name")?.unwrap_or(arch_name).to_string();
        let hidden = file.get_u32(&key("embedding_length"))? as usize;
        let heads = file.get_u32(&key("attention.head_count"))? as usize;
        let kv_heads = file.opt_u32(&key("attention.head_count_kv"))?.map_or(heads, |v| v as usize);
        let head_dim = match file.opt_u32(&key("attention.key_length"))? {
            Some(v) => v as usize,
            None => hidden.checked_div(heads).unwrap_or(0),
        };
        let vocab = match file.opt_u32(&key("vocab_size"))? {
            Some(v) => v as usize,
            None => file.get_string_array("tokenizer.ggml.tokens")?.len(),
        };
        let rotary_dim = file.opt_u32(&key("rope.dimension_count"))?.map_or(head_dim, |v| v as usize);
        let scaling = match file.opt_str(&key("rope.scaling.type"))? {
            None | Some("none") => RopeScaling::None,
            Some("linear") => {
                RopeScaling::Linear { factor: f64::from(file.get_f32(&key("rope.scaling.factor"))?) }
            }
            Some(other) => {
                return Err(Error::NotServed {
                    op: "model loading",
                    reason: format!("RoPE scaling `{other}` in GGUF"),
                })
            }
        };
        if file.tensor_info("rope_freqs.weight").is_some() {
            return Err(Error::NotServed {
                op: "model loading",
                reason: "per-frequency RoPE factors (rope_freqs.weight)".into(),
            });
        }
        let config = ModelConfig {
            name,
            architecture,
            hidden,
            layers: file.get_u32(&key("block_count"))? as usize,
            heads,
            kv_heads,
            head_dim,
            ffn: file.get_u32(&key("feed_forward_length"))? as usize,
            vocab,
            rms_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            rope: RopeSpec {
                // llama.cpp's converter permutes Llama's q and k rows so that GGUF llama models
                // rotate adjacent pairs; Qwen models keep the half-split layout.
                layout: match architecture {
                    Architecture::Llama => RopeLayout::Interleaved,
                    Architecture::Qwen2 | Architecture::Qwen3 => RopeLayout::HalfSplit,
                },
                rotary_dim,
                theta: f64::from(file.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0)),
                scaling,
            },
            context_length: file.opt_u32(&key("context_length"))?.map_or(4096, |v| v as usize),
            qkv_bias: architecture == Architecture::Qwen2,
            qk_norm: architecture == Architecture::Qwen3,
        };
        config.validate()?;
        Ok(config)
    }

    /// The configuration of a Hugging Face `config.json` (already parsed to JSON).
    pub fn from_hf_json(json: &serde_json::Value, name: &str) -> Result<ModelConfig> {
        let field = |k: &str| json.get(k).filter(|v| !v.is_null());
        let usize_field = |k: &str| -> Result<Option<usize>> {
            match field(k) {
                None => Ok(None),
                Some(v) => v.as_u64().and_then(|v| usize::try_from(v).ok()).map(Some).ok_or_else(|| {
                    model_error(name, format!("config.json: `{k}` is {v}, expected an unsigned integer"))
                }),
            }
        };
        let required = |k: &str| -> Result<usize> {
            usize_field(k)?.ok_or_else(|| model_error(name, format!("config.json: `{k}` is missing")))
        };
        let f64_field = |k: &str| -> Result<Option<f64>> {
            match field(k) {
                None => Ok(None),
                Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                    model_error(name, format!("config.json: `{k}` is {v}, expected a number"))
                }),
            }
        };
        let arch_name = field("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str())
            .or_else(|| field("model_type").and_then(|m| m.as_str()))
            .ok_or_else(|| model_error(name, "config.json names no architecture".into()))?;
        let architecture = Architecture::from_name(arch_name).ok_or_else(|| Error::NotServed {
            op: "model loading",
            reason: format!("architecture `{arch_name}` (Kiln runs Llama, Mistral, Qwen2, Qwen3)"),
        })?;
        let hidden = required("hidden_size")?;
        let heads = required("num_attention_heads")?;
        let kv_heads = usize_field("num_key_value_heads")?.unwrap_or(heads);
        let head_dim = usize_field("head_dim")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0));
        // transformers 5 writes `rope_parameters` (theta and scaling together); earlier versions
        // a top-level `rope_theta` and an optional `rope_scaling`.
        let parameters = field("rope_parameters").filter(|p| p.is_object());
        let theta = match parameters.and_then(|p| p.get("rope_theta")) {
            Some(v) => v.as_f64().ok_or_else(|| {
                model_error(
                    name,
                    format!("config.json: rope_parameters.rope_theta is {v}, expected a number"),
                )
            })?,
            None => f64_field("rope_theta")?.unwrap_or(10_000.0),
        };
        let scaling = match field("rope_scaling").filter(|s| !s.is_null()).or(parameters) {
            None => RopeScaling::None,
            Some(s) => {
                let kind =
                    s.get("rope_type").or_else(|| s.get("type")).and_then(|t| t.as_str()).unwrap_or("");
                let num = |k: &str, default: Option<f64>| -> Result<f64> {
                    s.get(k).and_then(|v| v.as_f64()).or(default).ok_or_else(|| {
                        model_error(name, format!("config.json: rope_scaling.{k} is missing or not a number"))
                    })
                };
                match kind {
                    "default" | "" if s.get("factor").is_none() => RopeScaling::None,
                    "default" => RopeScaling::None,
                    "linear" => RopeScaling::Linear { factor: num("factor", None)? },
                    "llama3" => RopeScaling::Llama3 {
                        factor: num("factor", None)?,
                        low_freq_factor: num("low_freq_factor", Some(1.0))?,
                        high_freq_factor: num("high_freq_factor", Some(4.0))?,
                        original_max_position: num("original_max_position_embeddings", Some(8192.0))?,
                    },
                    "yarn" => {
                        let factor = num("factor", None)?;
                        RopeScaling::Yarn {
                            factor,
                            original_max_position: num("original_max_position_embeddings", Some(4096.0))?,
                            beta_fast: num("beta_fast", Some(32.0))?,
                            beta_slow: num("beta_slow", Some(1.0))?,
                            attention_factor: num(
                                "attention_factor",
                                Some(RopeScaling::yarn_attention_factor(factor)),
                            )?,
                            truncate: s.get("truncate").and_then(|v| v.as_bool()).unwrap_or(true),
                        }
                    }
                    other => {
                        return Err(Error::NotServed {
                            op: "model loading",
                            reason: format!("rope_scaling type `{other}`"),
                        })
                    }
                }
            }
        };
        let config = ModelConfig {
            name: name.to_string(),
            architecture,
            hidden,
            layers: required("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            ffn: required("intermediate_size")?,
            vocab: required("vocab_size")?,
            rms_eps: f64_field("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope: RopeSpec { layout: RopeLayout::HalfSplit, rotary_dim: head_dim, theta, scaling },
            context_length: usize_field("max_position_embeddings")?.unwrap_or(4096),
            qkv_bias: architecture == Architecture::Qwen2
                || field("attention_bias").and_then(|b| b.as_bool()).unwrap_or(false),
            qk_norm: architecture == Architecture::Qwen3,
        };
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_json() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 128256,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        })
    }

    #[test]
    fn hf_config_reads_llama_32() {
        let c = ModelConfig::from_hf_json(&llama_json(), "l").unwrap();
        assert_eq!((c.hidden, c.heads, c.kv_heads, c.head_dim, c.layers), (2048, 32, 8, 64, 16));
        assert!(matches!(c.rope.scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0));
        assert_eq!(c.rope.layout, RopeLayout::HalfSplit);
    }

    #[test]
    fn hf_config_errors_name_the_field() {
        let mut j = llama_json();
        j["num_key_value_heads"] = serde_json::json!(7);
        let e = ModelConfig::from_hf_json(&j, "l").unwrap_err().to_string();
        assert!(e.contains("not a multiple of 7 KV heads"), "{e}");
        let mut j = llama_json();
        j.as_object_mut().unwrap().remove("hidden_size");
        let e = ModelConfig::from_hf_json(&j, "l").unwrap_err().to_string();
        assert!(e.contains("`hidden_size` is missing"), "{e}");
        let mut j = llama_json();
        j["hidden_size"] = serde_json::json!(-4);
        let e = ModelConfig::from_hf_json(&j, "l").unwrap_err().to_string();
        assert!(e.contains("expected an unsigned integer"), "{e}");
        let mut j = llama_json();
        j["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
        assert!(matches!(ModelConfig::from_hf_json(&j, "l"), Err(Error::NotServed { .. })));
        let mut j = llama_json();
        j["num_attention_heads"] = serde_json::json!(0);
        assert!(ModelConfig::from_hf_json(&j, "l").unwrap_err().to_string().contains("head count is 0"));
    }

    #[test]
    fn hf_config_reads_transformers_5_rope_parameters() {
        // transformers 5 keeps theta and scaling in `rope_parameters`, with no `rope_theta`.
        let mut j = llama_json();
        let o = j.as_object_mut().unwrap();
        o.remove("rope_theta");
        o.remove("rope_scaling");
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "default", "rope_theta": 1000000.0}),
        );
        let c = ModelConfig::from_hf_json(&j, "q").unwrap();
        assert_eq!(c.rope.theta, 1_000_000.0);
        assert!(matches!(c.rope.scaling, RopeScaling::None));
        let o = j.as_object_mut().unwrap();
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}),
        );
        let c = ModelConfig::from_hf_json(&j, "l").unwrap();
        assert_eq!(c.rope.theta, 500_000.0);
        assert!(matches!(c.rope.scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        j["rope_parameters"] = serde_json::json!({"rope_theta": "big"});
        let e = ModelConfig::from_hf_json(&j, "l").unwrap_err().to_string();
        assert!(e.contains("rope_parameters.rope_theta"), "{e}");
    }
}
