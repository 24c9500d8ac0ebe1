//! `kiln`: run large language models on NVIDIA GPUs and on any CPU.
//!
//! Each subcommand lives in its own module; adding one is a variant of [`Command`] and a line
//! in [`dispatch`].

mod bench_norm;
mod generate;
mod logging;
mod pull;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Kiln runs large language models (GGUF, safetensors) on NVIDIA GPUs and on any CPU.
#[derive(Debug, Parser)]
#[command(name = "kiln", version, about, long_about = None, propagate_version = true)]
struct Cli {
    /// More logging: -v debug, -vv trace and the whole error chain with its backtrace.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate text from a prompt (fetches the default model on first use).
    Generate(generate::GenerateArgs),
    /// Fetch a known model into the cache.
    Pull(pull::PullArgs),
    /// Benchmarks against the hardware's ceiling and a peer.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The norm kernels (RMSNorm, LayerNorm, residual, quantized outputs) on the GPU.
    Norm(bench_norm::BenchNormArgs),
}

fn dispatch(command: Command) -> kiln_core::Result<ExitCode> {
    match command {
        Command::Generate(args) => generate::run(args),
        Command::Pull(args) => pull::run(args),
        Command::Bench(BenchCommand::Norm(args)) => bench_norm::run(&args).map(|()| ExitCode::SUCCESS),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = logging::init(cli.verbose) {
        eprintln!("kiln: {e}");
        return ExitCode::from(2);
    }
    match dispatch(cli.command) {
        Ok(code) => code,
        Err(e) => {
            logging::report(&e, cli.verbose);
            ExitCode::FAILURE
        }
    }
}
