//! The binary certificate index: key → winner, read without parsing JSON.
//!
//! Layout (all integers little-endian):
//!
//! | bytes      | what                                                        |
//! |------------|-------------------------------------------------------------|
//! | 8          | magic `KILNTUNE`                                            |
//! | 4          | version (u32), [`INDEX_VERSION`]                            |
//! | 4          | entry count (u32)                                           |
//! | per entry  | key length (u32), key (UTF-8), winner length (u32), winner  |
//! | 32         | SHA-256 of every byte before it                             |
//!
//! Only strings are read back, never code; every length is checked against the bytes left, and
//! nothing may follow the last entry. A file that breaks any rule is refused with
//! [`Error::TuningStore`] naming it and the rule.

use std::collections::BTreeMap;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// The first eight bytes of every index.
pub const INDEX_MAGIC: &[u8; 8] = b"KILNTUNE";
/// The layout version this code writes and reads.
pub const INDEX_VERSION: u32 = 1;
const HEADER_BYTES: usize = 16;
const TRAILER_BYTES: usize = 32;
/// The longest key or winner string an index may hold.
const MAX_STRING_BYTES: usize = 4096;

/// Encodes `entries` (key string → winner), in key order.
pub fn encode(entries: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let too_long = |what: &str, s: &str| Error::InvalidArgument {
        name: "tuning index entry",
        value: format!("{what} of {} bytes", s.len()),
        reason: format!("at most {MAX_STRING_BYTES} bytes"),
    };
    let count = u32::try_from(entries.len()).map_err(|_| Error::InvalidArgument {
        name: "tuning index entries",
        value: entries.len().to_string(),
        reason: "more than u32::MAX".into(),
    })?;
    let mut bytes = Vec::with_capacity(HEADER_BYTES + TRAILER_BYTES + entries.len() * 64);
    bytes.extend_from_slice(INDEX_MAGIC);
    bytes.extend_from_slice(&INDEX_VERSION.to_le_bytes());
    bytes.extend_from_slice(&count.to_le_bytes());
    for (key, winner) in entries {
        for (what, s) in [("key", key), ("winner", winner)] {
            if s.len() > MAX_STRING_BYTES {
                return Err(too_long(what, s));
            }
            bytes.extend_from_slice(&(s.len() as u32).to_le_bytes());
            bytes.extend_from_slice(s.as_bytes());
        }
    }
    let digest = Sha256::digest(&bytes);
    bytes.extend_from_slice(&digest);
    Ok(bytes)
}

/// Decodes and validates an index read from `path` (named in every error).
pub fn decode(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, String>> {
    let refuse = |reason: String| Error::TuningStore { path: path.to_path_buf(), reason };
    if bytes.len() < INDEX_MAGIC.len() || &bytes[..INDEX_MAGIC.len()] != INDEX_MAGIC {
        let found = &bytes[..bytes.len().min(INDEX_MAGIC.len())];
        return Err(refuse(format!("bad magic {found:02x?}, expected \"KILNTUNE\"")));
    }
    if bytes.len() < HEADER_BYTES + TRAILER_BYTES {
        return Err(refuse(format!(
            "truncated: {} bytes, fewer than the {} of a header and trailer",
            bytes.len(),
            HEADER_BYTES + TRAILER_BYTES
        )));
    }
    let (body, trailer) = bytes.split_at(bytes.len() - TRAILER_BYTES);
    if Sha256::digest(body).as_slice() != trailer {
        return Err(refuse("SHA-256 trailer does not match the contents (corrupt or truncated)".into()));
    }
    let mut reader = Reader { bytes: body, offset: INDEX_MAGIC.len() };
    let version = reader.u32().map_err(&refuse)?;
    if version != INDEX_VERSION {
        return Err(refuse(format!("unsupported version {version}, expected {INDEX_VERSION}")));
    }
    let count = reader.u32().map_err(&refuse)? as usize;
    // Each entry takes at least its two length fields.
    if count > reader.remaining() / 8 {
        return Err(refuse(format!("entry count {count} cannot fit in {} bytes", reader.remaining())));
    }
    let mut entries = BTreeMap::new();
    for i in 0..count {
        let key = reader.string(&format!("entry {i} key")).map_err(&refuse)?;
        let winner = reader.string(&format!("entry {i} winner")).map_err(&refuse)?;
        if entries.insert(key.clone(), winner).is_some() {
            return Err(refuse(format!("duplicate key `{key}`")));
        }
    }
    if reader.remaining() != 0 {
        return Err(refuse(format!("{} bytes after the last entry", reader.remaining())));
    }
    Ok(entries)
}

struct Reader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl Reader<'_> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.offset
    }

    fn take(&mut self, n: usize, what: &str) -> std::result::Result<&[u8], String> {
        if n > self.remaining() {
            return Err(format!(
                "truncated at byte {} reading {what}: {n} bytes needed, {} left",
                self.offset,
                self.remaining()
            ));
        }
        let slice = &self.bytes[self.offset..self.offset + n];
        self.offset += n;
        Ok(slice)
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        let b = self.take(4, "a u32")?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn string(&mut self, what: &str) -> std::result::Result<String, String> {
        let len = self.u32()? as usize;
        if len == 0 || len > MAX_STRING_BYTES {
            return Err(format!("{what}: length {len} outside 1..={MAX_STRING_BYTES}"));
        }
        let b = self.take(len, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }
}
