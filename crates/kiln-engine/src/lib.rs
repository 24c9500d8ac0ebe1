//! `kiln-engine`: formats, tokenizers, models, KV cache, sampling and the generation loop.

pub mod chat;
pub mod fetch;
pub mod formats;
pub mod generate;
pub mod kv;
pub mod models;
pub mod tokenizer;
