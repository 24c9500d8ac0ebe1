//! `kiln-engine`: formats, tokenizers, models, KV cache, sampling and the generation loop.

pub mod fetch;
pub mod generate;
pub mod models;
pub mod formats;
pub mod chat;
pub mod tokenizer;
