//! Any GGUF file that reads gives a tokenizer or a named error from the tokenizer loader.
//!
//! `cargo +nightly fuzz run tokenizer_gguf ../crates/kiln-engine/tests/corpus/gguf`

#![no_main]

use kiln_engine::formats::GgufFile;
use kiln_engine::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec(), "fuzz.gguf") else { return };
    let _ = Tokenizer::from_gguf(&file);
});
