//! `kiln tune`: the tuning certificates.
//!
//! - `kiln tune certify` measures the keys a model asks for (found by walking its shapes: hidden
//!   size, vocabulary, heads, head size, KV heads and the weights' types) on GPU 0 with
//!   `kiln_cuda::certify`, and writes one certificate per key, by default into this machine's
//!   `$KILN_CACHE_DIR/tuning/certificates` (`--out tuning/certificates` for the shipped set). At the
//!   end it prints, per key, the certified configuration's time against the declared default's and
//!   the slowest correct candidate's (markdown; `--report FILE` saves it).
//! - `kiln tune show` lists them: key, winner, each candidate's time, error and status.
//!
//! Certificates are read from `--dir` (repeatable), else from the shipped `tuning/certificates`
//! (beside the `kiln` binary, else under the current directory) and
//! `$KILN_CACHE_DIR/tuning/certificates` (this machine's). Each is validated as the store
//! validates it; a malformed one is an error naming its file.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressStyle};
use kiln_core::tuning::store::{load_certificates, record_certificate, tuning_cache_dir};
use kiln_core::tuning::{CandidateStatus, Certificate, TuningStore};
use kiln_core::{DType, Error, Result};
use kiln_cuda::certify::{
    certify, generator, tasks, Certified, CertifyOptions, Family, ModelShapes, KILN_VERSION,
};
use kiln_cuda::Gpu;
use kiln_engine::fetch::{self, DEFAULT_MODEL};
use kiln_engine::formats::GgufFile;
use kiln_engine::models::ModelConfig;

use crate::output;
use crate::pull::BarProgress;

/// The `kiln tune` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum TuneCommand {
    /// Measure and certify the kernel configurations a model's shapes ask for, on GPU 0.
    Certify(CertifyArgs),
    /// List the certificates: key, winner, and each candidate's time and error.
    Show(ShowArgs),
}

/// Which model's shapes: `--model` (a GGUF file, a Hugging Face folder, a known name, or
/// `default`) or `--shapes` (a built-in set). Neither means `--model default`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ShapeArgs {
    /// A GGUF file, a Hugging Face folder, a known model name, or `default`.
    #[arg(long, conflicts_with = "shapes")]
    pub model: Option<String>,
    /// A built-in shape set instead of a model: `llama3-8b`, `smollm2-135m` (the default model's).
    #[arg(long)]
    pub shapes: Option<String>,
}

/// Arguments of `kiln tune certify`.
#[derive(Debug, clap::Args)]
pub struct CertifyArgs {
    /// Only this kernel family: norm, lm-head, attention.
    #[arg(long)]
    kernel: Option<String>,
    #[command(flatten)]
    shapes: ShapeArgs,
    /// Where to write the certificates (default `$KILN_CACHE_DIR/tuning/certificates`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also measure a planted wrong candidate per key (the fastest variant with one output
    /// element perturbed after its launch), to show it is rejected.
    #[arg(long)]
    plant_wrong: bool,
    /// Also write the table (markdown) here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Timed batches per candidate (the median is kept).
    #[arg(long, default_value_t = 15)]
    batches: usize,
    /// Launches per batch, each on the next input set.
    #[arg(long, default_value_t = 10)]
    launches: usize,
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
        TuneCommand::Certify(args) => certify_command(args),
        TuneCommand::Show(args) => show(args),
    }
}

/// The shipped certificates: `tuning/certificates` beside the `kiln` binary (the GPU bundle's
/// layout), else under the current directory.
pub fn shipped_dir() -> PathBuf {
    let relative = Path::new("tuning").join("certificates");
    let beside_binary = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join(&relative)));
    beside_binary.filter(|d| d.is_dir()).unwrap_or(relative)
}

/// The folders of the certificates the store reads: the shipped ones and this machine's.
pub fn store_dirs() -> Result<Vec<PathBuf>> {
    TuningStore::default_dirs(&shipped_dir())
}

/// The store the kernels consult: the shipped certificates and this machine's, `KILN_TUNING`'s mode.
pub fn open_store() -> Result<TuningStore> {
    TuningStore::open_default(&shipped_dir())
}

/// The shapes `args` name (see [`ShapeArgs`]).
pub fn model_shapes(args: &ShapeArgs) -> Result<ModelShapes> {
    if let Some(name) = &args.shapes {
        return ModelShapes::named(name);
    }
    let spec = match args.model.as_deref() {
        None | Some("default") => DEFAULT_MODEL,
        Some(spec) => spec,
    };
    let path = fetch::resolve_model(spec, &mut BarProgress::new())?;
    if path.is_dir() {
        hf_shapes(&path)
    } else {
        gguf_shapes(&path)
    }
}

fn shapes_of(config: &ModelConfig, norm_weight: DType, lm_head_weight: DType) -> ModelShapes {
    ModelShapes {
        name: config.name.clone(),
        hidden: config.hidden,
        vocab: config.vocab,
        q_heads: config.heads,
        kv_heads: config.kv_heads,
        head_dim: config.head_dim,
        rms_eps: config.rms_eps,
        qk_norm: config.qk_norm,
        norm_weight,
        lm_head_weight,
    }
}

/// A GGUF model's shapes, with the stored types of its first norm weight and its output layer
/// (the token embedding when the output is tied to it).
fn gguf_shapes(path: &Path) -> Result<ModelShapes> {
    let file = GgufFile::open(path)?;
    let config = ModelConfig::from_gguf(&file)?;
    let dtype_of = |names: &[&str]| {
        names.iter().find_map(|n| file.tensor_info(n)).map(|t| t.dtype).ok_or_else(|| Error::Model {
            model: config.name.clone(),
            reason: format!("no tensor {}", names.join(" or ")),
        })
    };
    let norm = dtype_of(&["blk.0.attn_norm.weight"])?;
    let output = dtype_of(&["output.weight", "token_embd.weight"])?;
    Ok(shapes_of(&config, norm, output))
}

/// A Hugging Face folder's shapes; every weight of the `torch_dtype` of its `config.json`.
fn hf_shapes(dir: &Path) -> Result<ModelShapes> {
    let (json, config) = kiln_engine::models::read_hf_config(dir)?;
    let dtype = match json.get("torch_dtype").and_then(|v| v.as_str()) {
        None | Some("bfloat16") => DType::BF16,
        Some("float16") => DType::F16,
        Some("float32") => DType::F32,
        Some(other) => {
            return Err(Error::Model {
                model: config.name.clone(),
                reason: format!("config.json: torch_dtype `{other}` (bfloat16, float16 or float32)"),
            })
        }
    };
    Ok(shapes_of(&config, dtype, dtype))
}

fn certify_command(args: &CertifyArgs) -> Result<ExitCode> {
    let families = match &args.kernel {
        Some(name) => vec![Family::parse(name)?],
        None => Family::ALL.to_vec(),
    };
    let model = model_shapes(&args.shapes)?;
    let out = match &args.out {
        Some(dir) => dir.clone(),
        None => tuning_cache_dir()?.join("certificates"),
    };
    let gpu = Gpu::open(0)?;
    let arch = gpu.arch();
    let tasks = tasks(&model, &families, arch)?;
    let options = CertifyOptions {
        batches: args.batches,
        launches: args.launches,
        plant_wrong: args.plant_wrong,
        date: output::today(),
    };
    tracing::info!(
        "certifying {} keys of {} on {} ({arch}) into {}",
        tasks.len(),
        model.name,
        gpu.facts().name,
        out.display()
    );
    let bar = ProgressBar::new(tasks.len() as u64);
    if let Ok(style) = ProgressStyle::with_template("[{bar:30}] {pos}/{len} keys {elapsed} {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    let mut rows = Vec::with_capacity(tasks.len());
    for task in &tasks {
        let key = task.key(arch)?;
        bar.set_message(key.to_string());
        let certified =
            certify(&gpu, task, &options, &mut |label| bar.set_message(format!("{key}: {label}")))?;
        let path = record_certificate(&out, certified.certificate.clone())?;
        bar.println(format!("{key}: {} -> {}", certified.certificate.winner, path.display()));
        rows.push(summarize(task.family(), &task.describe(), &certified));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let facts = gpu.facts();
    let heading = format!(
        "{} · {} ({arch}) · driver CUDA {} · kiln {} · commit {} · shapes of {}",
        output::today(),
        facts.name,
        facts.driver_cuda_version,
        KILN_VERSION,
        output::commit(),
        model.name
    );
    let table = report(&heading, &rows);
    output::print(&table);
    if let Some(path) = &args.report {
        std::fs::write(path, &table).map_err(|e| Error::io(path, e))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// One key's line of the report.
#[derive(Debug, Clone, PartialEq)]
struct SummaryRow {
    family: Family,
    key: String,
    instance: String,
    certified: (String, f64),
    /// The declared default and its time, when it ran correctly.
    default: (String, Option<f64>),
    /// The slowest candidate that ran correctly.
    slowest: Option<(String, f64)>,
    /// The planted wrong candidate: name, time, and whether the certificate rejected it.
    planted: Option<(String, Option<f64>, bool)>,
}

fn summarize(family: Family, instance: &str, certified: &Certified) -> SummaryRow {
    let c = &certified.certificate;
    let time_of = |config: &str| c.candidates.iter().find(|x| x.config == config).filter(|x| x.is_eligible());
    let certified_time = time_of(&c.winner).map_or(f64::NAN, |x| x.score_us());
    let slowest = c
        .candidates
        .iter()
        .filter(|x| x.is_eligible())
        .max_by(|a, b| a.score_us().total_cmp(&b.score_us()))
        .map(|x| (x.config.clone(), x.score_us()));
    let planted = certified.planted.as_ref().and_then(|name| {
        c.candidates.iter().find(|x| &x.config == name).map(|x| (name.clone(), x.time_us, !x.is_eligible()))
    });
    SummaryRow {
        family,
        key: c.key.to_string(),
        instance: instance.to_owned(),
        certified: (c.winner.clone(), certified_time),
        default: (certified.default_config.clone(), time_of(&certified.default_config).map(|x| x.score_us())),
        slowest,
        planted,
    }
}

/// The markdown table: per key, certified vs declared default vs slowest correct candidate.
fn report(heading: &str, rows: &[SummaryRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Certified kernel configurations\n\n{heading}\n");
    let _ = writeln!(
        s,
        "Times are CUDA-event medians per launch over inputs rotated beyond twice the L2 cache \
         (norms and decode attention: launches captured in a CUDA graph and replayed, as in the \
         engine's decode step); the slowest is the slowest candidate that was correct.\n"
    );
    let _ = writeln!(
        s,
        "| family | key | timed instance | certified | µs | declared default | µs | slowest | µs | \
         default / certified | slowest / certified |"
    );
    let _ = writeln!(s, "| --- | --- | --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: |");
    let us = |t: Option<f64>| t.map_or("-".to_owned(), |t| format!("{t:.2}"));
    let ratio = |t: Option<f64>, base: f64| t.map_or("-".to_owned(), |t| format!("{:.2}x", t / base));
    for r in rows {
        let (certified, base) = (&r.certified.0, r.certified.1);
        let slowest = r.slowest.as_ref().map(|(_, t)| *t);
        let _ = writeln!(
            s,
            "| {} | `{}` | {} | `{certified}` | {base:.2} | `{}` | {} | {} | {} | {} | {} |",
            r.family,
            r.key,
            r.instance,
            r.default.0,
            us(r.default.1),
            r.slowest.as_ref().map_or("-".to_owned(), |(c, _)| format!("`{c}`")),
            us(slowest),
            ratio(r.default.1, base),
            ratio(slowest, base),
        );
    }
    let planted: Vec<&SummaryRow> = rows.iter().filter(|r| r.planted.is_some()).collect();
    if !planted.is_empty() {
        let _ = writeln!(
            s,
            "\nPlanted wrong candidates (the fastest variant, one output element perturbed after the \
             launch):\n\n| key | planted | µs | certified | µs | rejected |\n| --- | --- | ---: | --- | ---: | --- |"
        );
        for r in planted {
            if let Some((name, time, rejected)) = &r.planted {
                let _ = writeln!(
                    s,
                    "| `{}` | `{name}` | {} | `{}` | {:.2} | {} |",
                    r.key,
                    us(*time),
                    r.certified.0,
                    r.certified.1,
                    if *rejected { "yes: wrong result" } else { "NO" }
                );
            }
        }
    }
    s
}

fn show(args: &ShowArgs) -> Result<ExitCode> {
    let dirs = if args.dirs.is_empty() { store_dirs()? } else { args.dirs.clone() };
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

/// `stale: ...` when the kernel source of `c`'s family (prelude and `.cu` file, hashed as
/// [`generator`] does) is no longer the source it timed: its winner still runs, but the proof is of
/// other code. `None` when the source is the same, or the key names no known family.
pub fn staleness(c: &Certificate) -> Option<String> {
    let family = Family::parse(&c.key.kernel).ok()?;
    let now = generator(family);
    (now.source_sha256 != c.generator.source_sha256).then(|| {
        format!(
            "stale: the {family} kernel source is now {} (not {}); `kiln tune certify --kernel {family}` proves it again",
            short(&now.source_sha256),
            short(&c.generator.source_sha256)
        )
    })
}

/// One certificate as a block of lines; the winner's row is marked `*`, and a [`staleness`] line
/// follows the key.
fn describe(c: &Certificate) -> String {
    let mut text = String::new();
    let _ = writeln!(text, "\n{}  winner {}", c.key, c.winner);
    if let Some(stale) = staleness(c) {
        let _ = writeln!(text, "  {stale}");
    }
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
        assert!(!text.contains("stale"), "a key of no known family is not judged: {text}");
    }

    #[test]
    fn describe_says_when_the_kernel_source_changed_since_the_proof() {
        let key = TuningKey::new("norm", "rms.hf.n4096.g1.rows1", "f32.f32.f32", "sm_90").unwrap();
        let candidates = vec![CandidateResult::ok("4w1r", 3.25, 0.0), CandidateResult::ok("8w1r", 4.5, 0.0)];
        let certificate = |generator| {
            Certificate::new(
                key.clone(),
                candidates.clone(),
                generator,
                "NVIDIA H200",
                "CUDA 13.0",
                "2026-11-30",
            )
            .unwrap()
        };
        let old = Generator { kiln_version: "0.1.0".into(), source_sha256: "ab".repeat(32) };
        let text = describe(&certificate(old));
        let now = generator(Family::Norm).source_sha256;
        assert!(
            text.contains(&format!("stale: the norm kernel source is now {} (not abababababab)", &now[..12])),
            "{text}"
        );
        let text = describe(&certificate(generator(Family::Norm)));
        assert!(!text.contains("stale"), "{text}");
    }

    fn certified_for_test(plant: bool) -> Certified {
        use kiln_core::tuning::CandidateResult;
        let key = TuningKey::new("norm", "rms.res.hf.n4096.g1.rows1", "bf16.bf16.bf16", "sm_90").unwrap();
        let mut candidates = vec![
            CandidateResult::ok("4w1r", 4.0, 0.0),
            CandidateResult::ok("2w2r+e", 3.0, 0.0),
            CandidateResult::ok("1w4r", 9.5, 0.0),
            CandidateResult {
                config: "16w1r".into(),
                time_us: Some(50.0),
                error: Some(12.0),
                status: CandidateStatus::WrongResult { detail: "12 bytes differ".into() },
            },
        ];
        if plant {
            candidates.push(CandidateResult {
                config: "planted-wrong(2w2r+e)".into(),
                time_us: Some(2.9),
                error: Some(1.0),
                status: CandidateStatus::WrongResult { detail: "1 bytes differ".into() },
            });
        }
        let generator = Generator { kiln_version: "0.1.0".into(), source_sha256: "ab".repeat(32) };
        let certificate =
            Certificate::new(key, candidates, generator, "NVIDIA H200", "CUDA 13.0", "2026-11-30").unwrap();
        Certified {
            certificate,
            default_config: "4w1r".into(),
            planted: plant.then(|| "planted-wrong(2w2r+e)".to_owned()),
        }
    }

    #[test]
    fn the_report_compares_certified_default_and_slowest_correct() {
        let row = summarize(Family::Norm, "1 rows x 4096", &certified_for_test(true));
        assert_eq!(row.certified, ("2w2r+e".to_owned(), 3.0));
        assert_eq!(row.default, ("4w1r".to_owned(), Some(4.0)));
        // The wrong candidate's 50 us is not the slowest: only correct runs count.
        assert_eq!(row.slowest, Some(("1w4r".to_owned(), 9.5)));
        assert_eq!(row.planted, Some(("planted-wrong(2w2r+e)".to_owned(), Some(2.9), true)));
        let table = report("heading", &[row]);
        assert!(
            table.contains(
                "| norm | `norm/rms.res.hf.n4096.g1.rows1/bf16.bf16.bf16/sm_90` | 1 rows x 4096 | `2w2r+e` | 3.00 \
                 | `4w1r` | 4.00 | `1w4r` | 9.50 | 1.33x | 3.17x |"
            ),
            "{table}"
        );
        assert!(
            table.contains("| `planted-wrong(2w2r+e)` | 2.90 | `2w2r+e` | 3.00 | yes: wrong result |"),
            "{table}"
        );
        let plain = report("heading", &[summarize(Family::Norm, "x", &certified_for_test(false))]);
        assert!(!plain.contains("Planted"), "{plain}");
    }

    /// The built-in `smollm2-135m` set is what the default model's GGUF says.
    #[test]
    #[ignore = "needs KILN_TEST_MODEL (the default model's GGUF)"]
    fn the_smollm2_shape_set_matches_the_default_model() {
        let path = std::env::var("KILN_TEST_MODEL").expect("KILN_TEST_MODEL names the default model's GGUF");
        let from_file = model_shapes(&ShapeArgs { model: Some(path), shapes: None }).unwrap();
        let built_in = ModelShapes::named("smollm2-135m").unwrap();
        assert_eq!(ModelShapes { name: built_in.name.clone(), ..from_file }, built_in);
    }

    #[test]
    fn shapes_come_from_a_built_in_set_or_a_model_folder() {
        let args = ShapeArgs { model: None, shapes: Some("llama3-8b".into()) };
        assert_eq!(model_shapes(&args).unwrap(), ModelShapes::llama3_8b());
        let args = ShapeArgs { model: None, shapes: Some("gpt-2".into()) };
        assert!(matches!(model_shapes(&args), Err(Error::InvalidArgument { name: "--shapes", .. })));

        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let dir = std::env::temp_dir().join(format!("kiln-tune-shapes-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = r#"{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 2,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
            "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 40960, "torch_dtype": "float16"}"#;
        std::fs::write(dir.join("config.json"), config).unwrap();
        let args = ShapeArgs { model: Some(dir.display().to_string()), shapes: None };
        let shapes = model_shapes(&args).unwrap();
        assert_eq!(
            (shapes.hidden, shapes.vocab, shapes.q_heads, shapes.kv_heads, shapes.head_dim),
            (1024, 151_936, 16, 8, 128)
        );
        assert!(shapes.qk_norm);
        assert_eq!((shapes.norm_weight, shapes.lm_head_weight), (DType::F16, DType::F16));
        std::fs::write(dir.join("config.json"), config.replace("float16", "int4")).unwrap();
        assert!(matches!(model_shapes(&args), Err(Error::Model { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
