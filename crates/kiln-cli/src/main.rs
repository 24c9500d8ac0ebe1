//! `kiln`: run language models on NVIDIA GPUs and on any CPU.
//!
//! Each subcommand lives in its own module with an `Args` struct and a `run` function returning
//! the process's exit code; adding one is a variant in [`Command`] and a line in [`dispatch`].
//!
//! Exit codes: 0 success, 1 failure (the error and its causes are printed), 2 bad usage.

mod bench;
mod bench_attention;
mod bench_generate;
mod bench_lm_head;
mod bench_norm;
mod bench_sample;
mod doctor;
mod generate;
mod output;
mod plan;
mod pull;
mod tune;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kiln_core::{Error, Result};
use tracing_subscriber::filter::LevelFilter;

#[derive(Debug, Parser)]
#[command(name = "kiln", version, about = "Run language models on NVIDIA GPUs and on any CPU")]
struct Cli {
    /// More logging: -v debug, -vv trace and the error's full structure. `KILN_LOG` sets the
    /// level otherwise (debug, info, warn, error).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate text from a prompt (fetches the default model on first use).
    Generate(generate::GenerateArgs),
    /// Fetch a known model into the cache (`--list` shows the known models).
    Pull(pull::PullArgs),
    /// Check the CUDA driver, NVRTC, the GPUs and the kernel cache; compile and run a kernel.
    Doctor(doctor::DoctorArgs),
    /// The GPU memory a model takes (weights, activations, KV cache), before anything runs.
    Plan(plan::PlanArgs),
    /// Benchmarks against the hardware ceiling and a peer.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Tuning certificates: which configuration each kernel runs, and the proof.
    #[command(subcommand)]
    Tune(tune::TuneCommand),
}

fn dispatch(command: &Command) -> Result<ExitCode> {
    match command {
        Command::Generate(args) => generate::run(args),
        Command::Pull(args) => pull::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Tune(args) => tune::run(args),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = init_logging(cli.verbose) {
        print_error(&e, cli.verbose);
        return ExitCode::FAILURE;
    }
    match dispatch(&cli.command) {
        Ok(code) => code,
        Err(e) => {
            print_error(&e, cli.verbose);
            ExitCode::FAILURE
        }
    }
}

/// The level from `-v` flags, else `KILN_LOG`, else INFO; any other `KILN_LOG` value is refused.
fn log_level(verbose: u8, kiln_log: Option<&str>) -> Result<LevelFilter> {
    match verbose {
        0 => {}
        1 => return Ok(LevelFilter::DEBUG),
        _ => return Ok(LevelFilter::TRACE),
    }
    match kiln_log {
        None | Some("") | Some("info") => Ok(LevelFilter::INFO),
        Some("debug") => Ok(LevelFilter::DEBUG),
        Some("warn") => Ok(LevelFilter::WARN),
        Some("error") => Ok(LevelFilter::ERROR),
        Some(other) => Err(Error::BadSetting {
            name: "KILN_LOG",
            value: other.to_owned(),
            allowed: "debug, info, warn, error",
        }),
    }
}

/// One handler, on stderr, so stdout stays for results.
fn init_logging(verbose: u8) -> Result<()> {
    let kiln_log = std::env::var("KILN_LOG").ok();
    let level = log_level(verbose, kiln_log.as_deref())?;
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_target(verbose >= 2)
        .init();
    Ok(())
}

/// The error and each of its causes, one per line; with `-vv` also its full structure.
fn print_error(error: &Error, verbose: u8) {
    eprintln!("error: {error}");
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        eprintln!("  caused by: {cause}");
        source = cause.source();
    }
    if verbose >= 2 {
        eprintln!("{error:#?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kiln_log_accepts_the_four_levels_and_refuses_others_by_name() {
        assert_eq!(log_level(0, None).ok(), Some(LevelFilter::INFO));
        assert_eq!(log_level(0, Some("debug")).ok(), Some(LevelFilter::DEBUG));
        assert_eq!(log_level(0, Some("warn")).ok(), Some(LevelFilter::WARN));
        assert_eq!(log_level(0, Some("error")).ok(), Some(LevelFilter::ERROR));
        assert_eq!(log_level(1, Some("error")).ok(), Some(LevelFilter::DEBUG));
        assert_eq!(log_level(2, None).ok(), Some(LevelFilter::TRACE));
        match log_level(0, Some("verbose")) {
            Err(Error::BadSetting { name: "KILN_LOG", value, .. }) => assert_eq!(value, "verbose"),
            other => panic!("expected BadSetting, got {other:?}"),
        }
    }

    #[test]
    fn the_command_line_parses() {
        Cli::command_for_test();
    }

    /// Negative sampling values reach the sampler's named checks: negative presence and frequency
    /// penalties are valid (they favour tokens already seen), a negative temperature is refused
    /// by `SamplingParams::validate`, not taken for a flag by the parser.
    #[test]
    fn negative_sampling_values_are_values_not_flags() {
        let args =
            ["kiln", "generate", "-p", "hi", "--presence-penalty", "-0.5", "--frequency-penalty", "-1"];
        let cli = Cli::try_parse_from(args.iter().chain(&["--temperature", "-1"])).map_err(|e| e.to_string());
        match cli {
            Ok(Cli { command: Command::Generate(g), .. }) => {
                assert_eq!((g.presence_penalty, g.frequency_penalty, g.temperature), (-0.5, -1.0, -1.0));
            }
            other => panic!("expected generate arguments, got {other:?}"),
        }
        let cli = Cli::try_parse_from(args.iter().chain(&["--top-p", "-0.25"])).map_err(|e| e.to_string());
        assert!(
            matches!(cli, Ok(Cli { command: Command::Generate(ref g), .. }) if g.top_p == -0.25),
            "{cli:?}"
        );
    }

    /// A `--variants` label that names no variant is refused by name before the GPU is opened (on
    /// a machine without one, opening it first answered with the missing driver instead).
    #[test]
    fn a_wrong_norm_variant_label_is_named_before_the_gpu() {
        let args = ["kiln", "bench", "norm", "--sizes", "2048x4096", "--variants", "2w1r+b+nx"];
        let cli = Cli::try_parse_from(args).map_err(|e| e.to_string());
        let Ok(Cli { command: Command::Bench(bench::BenchCommand::Norm(norm)), .. }) = cli else {
            panic!("expected bench norm arguments, got {cli:?}");
        };
        match bench_norm::run(&norm) {
            Err(Error::InvalidArgument { name: "--variants", value, .. }) => assert_eq!(value, "2w1r+b+nx"),
            other => panic!("expected the label refused by name, got {other:?}"),
        }
    }

    impl Cli {
        fn command_for_test() {
            use clap::CommandFactory;
            Cli::command().debug_assert();
        }
    }
}
