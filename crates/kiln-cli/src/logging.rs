//! One stderr log handler. INFO by default; `-v` debug; `-vv` trace. `KILN_LOG` sets the level
//! by name (`debug`, `info`, `warn`, `error`); any other value is refused by name.

use std::error::Error as _;

use kiln_core::{Error, Result};
use tracing::Level;

/// The level `KILN_LOG` and the `-v` count ask for; the more verbose wins.
pub fn level(verbose: u8, env: Option<&str>) -> Result<Level> {
    let from_env = match env {
        None | Some("") => None,
        Some("error") => Some(Level::ERROR),
        Some("warn") => Some(Level::WARN),
        Some("info") => Some(Level::INFO),
        Some("debug") => Some(Level::DEBUG),
        Some(other) => {
            return Err(Error::BadSetting {
                name: "KILN_LOG",
                value: other.to_string(),
                allowed: "debug, info, warn, error",
            })
        }
    };
    let from_flags = match verbose {
        0 => None,
        1 => Some(Level::DEBUG),
        _ => Some(Level::TRACE),
    };
    // `Level` orders TRACE as the greatest (most verbose).
    Ok(match (from_env, from_flags) {
        (Some(a), Some(b)) => a.max(b),
        (a, b) => a.or(b).unwrap_or(Level::INFO),
    })
}

/// Installs the stderr handler.
pub fn init(verbose: u8) -> Result<()> {
    let env = std::env::var("KILN_LOG").ok();
    let level = level(verbose, env.as_deref())?;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .with_target(level >= Level::DEBUG)
        .without_time()
        .init();
    Ok(())
}

/// Prints an error: its message and causes; at `-vv` also its debug form and a backtrace.
pub fn report(error: &Error, verbose: u8) {
    eprintln!("kiln: error: {error}");
    let mut source = error.source();
    while let Some(cause) = source {
        eprintln!("  caused by: {cause}");
        source = cause.source();
    }
    if verbose >= 2 {
        eprintln!("{error:#?}");
        eprintln!("{}", std::backtrace::Backtrace::force_capture());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kiln_log_values() {
        assert_eq!(level(0, None).unwrap(), Level::INFO);
        assert_eq!(level(0, Some("warn")).unwrap(), Level::WARN);
        assert_eq!(level(1, None).unwrap(), Level::DEBUG);
        assert_eq!(level(2, Some("error")).unwrap(), Level::TRACE);
        match level(0, Some("verbose")) {
            Err(Error::BadSetting { name: "KILN_LOG", value, .. }) => assert_eq!(value, "verbose"),
            other => panic!("expected BadSetting, got {other:?}"),
        }
    }
}
