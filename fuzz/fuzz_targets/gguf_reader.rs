//! Any bytes given to the GGUF reader give a file or a named error, never a panic; a file that
//! reads gives every tensor's bytes and first row without a panic either.
//!
//! `cargo +nightly fuzz run gguf_reader ../crates/kiln-engine/tests/corpus/gguf`

#![no_main]

use kiln_engine::formats::{dequantize_row, GgufFile};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec(), "fuzz.gguf") else { return };
    for (key, _) in file.metadata() {
        let _ = file.get_u32(key);
        let _ = file.get_str(key);
        let _ = file.get_string_array(key);
    }
    for info in file.tensor_infos() {
        let Ok(bytes) = file.tensor_bytes(&info.name) else { continue };
        let cols = info.dims[0];
        if let Ok(row_bytes) = info.dtype.bytes_for(cols) {
            if cols <= 1 << 16 && row_bytes as usize <= bytes.len() {
                let mut row = vec![0f32; cols as usize];
                let _ = dequantize_row(info.dtype, &bytes[..row_bytes as usize], &mut row);
            }
        }
    }
});
