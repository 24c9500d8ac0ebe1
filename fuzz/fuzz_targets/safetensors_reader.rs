//! Any bytes given to the safetensors checks give tensor descriptions or a named error.
//!
//! `cargo +nightly fuzz run safetensors_reader`

#![no_main]

use kiln_engine::formats::SafetensorsFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = SafetensorsFile::check_bytes(data);
});
