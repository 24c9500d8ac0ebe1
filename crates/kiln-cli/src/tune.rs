//! `kiln tune show`: the tuning certificates, each key's winner and every candidate's time and error.
//!
//! Certificates are read from `--dir` (repeatable), else from `tuning/certificates` under the
//! current directory (the repository's shipped defaults) and `$KILN_CACHE_DIR/tuning/certificates`
//! (this machine's). Each is validated as the store validates it; a malformed one is an error
//! naming its file.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use kiln_core::tuning::store::{load_certificates, tuning_cache_dir};
use kiln_core::tuning::{CandidateStatus, Certificate};
use kiln_core::{Error, Result};

use crate::output;

/// The `kiln tune` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum TuneCommand {
    /// List the certificates: key, winner, and each candidate's time and error.
    Show(ShowArgs),
}

/// Arguments of `kiln tune show`.
#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    /// A certificate directory (`<dir>/<kernel>/<key>.json`); repeat for several.
    #[arg(long = "dir")]
    dirs: Vec<PathBuf>,
    /// Only this kernel family's certificates.
    #[arg(long)]
    kernel: Option<String>,
    /// Print the certificates as JSON (for scripts).
    #[arg(long)]
    json: bool,
}

pub fn run(command: &TuneCommand) -> Result<ExitCode> {
    match command {
        TuneCommand::Show(args) => show(args),
    }
}

fn show(args: &ShowArgs) -> Result<ExitCode> {
    let dirs = if args.dirs.is_empty() {
        vec![PathBuf::from("tuning").join("certificates"), tuning_cache_dir()?.join("certificates")]
    } else {
        args.dirs.clone()
    };
    let certificates: Vec<Certificate> = load_certificates(&dirs)?
        .into_iter()
        .filter(|c| args.kernel.as_ref().is_none_or(|k| *k == c.key.kernel))
        .collect();
    if args.json {
        let json = serde_json::to_string_pretty(&certificates).map_err(|e| Error::InvalidArgument {
            name: "certificates",
            value: "JSON".into(),
            reason: e.to_string(),
        })?;
        output::print(&format!("{json}\n"));
    } else {
        let searched: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        output::print(&format!("{} certificates in {}\n", certificates.len(), searched.join(", ")));
        for certificate in &certificates {
            output::print(&describe(certificate));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One certificate as a block of lines; the winner's row is marked `*`.
fn describe(c: &Certificate) -> String {
    let mut text = String::new();
    let _ = writeln!(text, "\n{}  winner {}", c.key, c.winner);
    let _ = writeln!(
        text,
        "  kiln {} source {}  {}  driver {}  {}{}",
        c.generator.kiln_version,
        short(&c.generator.source_sha256),
        c.gpu,
        c.driver,
        c.date,
        if c.alternates.is_empty() {
            String::new()
        } else {
            format!("  ({} older proofs)", c.alternates.len())
        }
    );
    let width = c.candidates.iter().map(|x| x.config.len()).max().unwrap_or(0);
    for candidate in &c.candidates {
        let mark = if candidate.config == c.winner { '*' } else { ' ' };
        let time = candidate.time_us.map_or("-".to_string(), |t| format!("{t:.2} us"));
        let error = candidate.error.map_or("-".to_string(), |e| format!("{e:.3e}"));
        let status = match &candidate.status {
            CandidateStatus::Ok => "ok".to_string(),
            CandidateStatus::WrongResult { detail } => format!("wrong: {detail}"),
            CandidateStatus::Failed { detail } => format!("failed: {detail}"),
        };
        let _ =
            writeln!(text, "  {mark} {:<width$}  {time:>12}  error {error:>10}  {status}", candidate.config);
    }
    text
}

fn short(sha256: &str) -> &str {
    sha256.get(..12).unwrap_or(sha256)
}

#[cfg(test)]
mod tests {
    use kiln_core::tuning::{CandidateResult, Generator, TuningKey};

    use super::*;

    #[test]
    fn describe_marks_the_winner_and_shows_every_candidate() {
        let key = TuningKey::new("rms_norm", "h576", "bf16", "sm_90").unwrap();
        let mut candidates =
            vec![CandidateResult::ok("warps4", 3.25, 0.0), CandidateResult::ok("warps8", 4.5, 0.0)];
        candidates.push(CandidateResult {
            config: "warps16".into(),
            time_us: None,
            error: None,
            status: CandidateStatus::Failed { detail: "too many registers".into() },
        });
        let generator = Generator { kiln_version: "0.1.0".into(), source_sha256: "ab".repeat(32) };
        let c = Certificate::new(key, candidates, generator, "NVIDIA H200", "580.65", "2026-11-30").unwrap();
        let text = describe(&c);
        assert!(text.contains("rms_norm/h576/bf16/sm_90  winner warps4"), "{text}");
        assert!(text.contains("* warps4 "), "{text}");
        assert!(text.contains("4.50 us"), "{text}");
        assert!(text.contains("failed: too many registers"), "{text}");
        assert!(text.contains("source abababababab "), "{text}");
    }
}
