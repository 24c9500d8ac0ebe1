//! Kernel launchers, one module per kernel family (`kernels/<family>.cu`): validation against
//! what the kernel serves, the compile-time constants of a call, and the launch.

pub mod attention;
pub mod embedding;
pub mod lm_head;
pub mod norm;
pub mod rope;
pub mod sample;
