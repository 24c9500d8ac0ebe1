//! The CPU reference operations: the specification every GPU kernel matches.

pub mod attention;
pub mod embedding;
pub mod lm_head;
pub mod norm;
pub mod primitives;
pub mod quantize;
pub mod rope;
pub mod sample;
