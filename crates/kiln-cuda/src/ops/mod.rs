//! Kernel launchers, one module per kernel family (`kernels/<family>.cu`): validation against
//! what the kernel serves, the compile-time constants of a call, and the launch.

pub mod attention;
pub mod embedding;
pub mod forward;
pub mod linear;
pub mod lm_head;
pub mod norm;
pub mod rope;
pub mod sample;

use kiln_core::{Error, Result};

/// `Error::ByteLength` when the `what` buffer of a `family` call holds fewer than `want` bytes.
pub(crate) fn check_buffer(family: &str, what: &str, got: usize, want: usize) -> Result<()> {
    if got < want {
        return Err(Error::ByteLength {
            what: format!("{family} {what} buffer"),
            expected: want as u64,
            got: got as u64,
        });
    }
    Ok(())
}

/// `Error::InvalidArgument` when an optional buffer is given but unused by `owner`, or needed
/// by it but missing.
pub(crate) fn check_presence(owner: &str, what: &'static str, present: bool, wanted: bool) -> Result<()> {
    if present != wanted {
        return Err(Error::InvalidArgument {
            name: what,
            value: if present { "given" } else { "missing" }.to_owned(),
            reason: format!("the {owner} {} it", if wanted { "needs" } else { "does not use" }),
        });
    }
    Ok(())
}
