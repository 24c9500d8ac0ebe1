//! Where certificates live and how a kernel looks its configuration up.
//!
//! Certificates are JSON files, `<dir>/<kernel>/<shape_class>@<dtypes>@<arch>.json`, in one or more
//! directories: the repository's `tuning/certificates` (the shipped defaults) and
//! `$KILN_CACHE_DIR/tuning/certificates` (this machine's own); a later directory's certificate for a
//! key overrides an earlier one's. Lookup goes through a binary index ([`super::index`]) named after
//! the fingerprint of the files it was built from (SHA-256 of their names and contents), so a change
//! to any certificate names a new index, which is built on first use. An index that fails
//! validation is refused by name (logged as a warning) and rebuilt from the JSON.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{index, Certificate, TuningKey};
use crate::{Error, Result};

/// How a lookup of an uncertified key is answered (`KILN_TUNING`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TuningMode {
    /// The family's declared default runs; the miss is logged at debug level.
    #[default]
    Default,
    /// An uncertified key is [`Error::KeyNotCertified`].
    Strict,
}

impl TuningMode {
    /// Reads `KILN_TUNING`.
    pub fn from_env() -> Result<TuningMode> {
        TuningMode::parse(std::env::var("KILN_TUNING").ok().as_deref())
    }

    /// Parses a `KILN_TUNING` value: unset, empty or `default`, or `strict`; anything else is
    /// [`Error::BadSetting`].
    pub fn parse(value: Option<&str>) -> Result<TuningMode> {
        match value {
            None | Some("") | Some("default") => Ok(TuningMode::Default),
            Some("strict") => Ok(TuningMode::Strict),
            Some(other) => Err(Error::BadSetting {
                name: "KILN_TUNING",
                value: other.to_string(),
                allowed: "strict, default (or unset)",
            }),
        }
    }
}

/// The certified winners of every key in a set of certificate directories.
#[derive(Debug)]
pub struct TuningStore {
    mode: TuningMode,
    index_path: PathBuf,
    winners: BTreeMap<String, String>,
}

impl TuningStore {
    /// Opens the certificates under `certificate_dirs` (missing directories hold none), using or
    /// building the index in `index_dir`.
    pub fn open(certificate_dirs: &[PathBuf], index_dir: &Path, mode: TuningMode) -> Result<TuningStore> {
        let files = certificate_files(certificate_dirs)?;
        let fingerprint = fingerprint(&files);
        let index_path = index_dir.join(format!("{fingerprint}.index"));
        match std::fs::read(&index_path) {
            Ok(bytes) => match index::decode(&index_path, &bytes) {
                Ok(winners) => return Ok(TuningStore { mode, index_path, winners }),
                Err(refused) => tracing::warn!("{refused}; rebuilding it from the certificates"),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&index_path, e)),
        }
        let mut winners = BTreeMap::new();
        for file in &files {
            let certificate = parse_certificate(&file.path, &file.contents)?;
            winners.insert(certificate.key.to_string(), certificate.winner);
        }
        let bytes = index::encode(&winners)?;
        // A cache that cannot be written costs a rebuild next time, not the run.
        if let Err(e) = write_atomically(&index_path, &bytes) {
            tracing::warn!("cannot write the tuning index: {e}");
        }
        Ok(TuningStore { mode, index_path, winners })
    }

    /// The store Kiln uses: the shipped certificates under `shipped_dir` and this machine's under
    /// `$KILN_CACHE_DIR/tuning/certificates`, the index in `$KILN_CACHE_DIR/tuning/index`, the mode
    /// from `KILN_TUNING`.
    pub fn open_default(shipped_dir: &Path) -> Result<TuningStore> {
        let mode = TuningMode::from_env()?;
        let dirs = TuningStore::default_dirs(shipped_dir)?;
        TuningStore::open(&dirs, &tuning_cache_dir()?.join("index"), mode)
    }

    /// The certificate folders [`TuningStore::open_default`] reads: the shipped ones under
    /// `shipped_dir`, then this machine's under `$KILN_CACHE_DIR/tuning/certificates`.
    pub fn default_dirs(shipped_dir: &Path) -> Result<Vec<PathBuf>> {
        Ok(vec![shipped_dir.to_path_buf(), tuning_cache_dir()?.join("certificates")])
    }

    /// The index file this store was read from or built into.
    pub fn index_path(&self) -> &Path {
        &self.index_path
    }

    /// The mode lookups answer in.
    pub fn mode(&self) -> TuningMode {
        self.mode
    }

    /// The certified winner of `key`, if any.
    pub fn winner(&self, key: &TuningKey) -> Option<&str> {
        self.winners.get(&key.to_string()).map(String::as_str)
    }

    /// The configuration to run for `key`: its certified winner; else, in strict mode,
    /// [`Error::KeyNotCertified`], and otherwise `declared_default` (the miss logged at debug).
    pub fn config_for<'a>(&'a self, key: &TuningKey, declared_default: &'a str) -> Result<&'a str> {
        if let Some(winner) = self.winner(key) {
            return Ok(winner);
        }
        match self.mode {
            TuningMode::Strict => {
                Err(Error::KeyNotCertified { kernel: key.kernel.clone(), key: key.to_string() })
            }
            TuningMode::Default => {
                tracing::debug!(
                    "no certificate for {key}; running the declared default `{declared_default}`"
                );
                Ok(declared_default)
            }
        }
    }

    /// Every certified key and its winner, in key order.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &str)> {
        self.winners.iter().map(|(k, w)| (k.as_str(), w.as_str()))
    }
}

/// `$KILN_CACHE_DIR/tuning`, else `$XDG_CACHE_HOME/kiln/tuning`, else `~/.cache/kiln/tuning`.
pub fn tuning_cache_dir() -> Result<PathBuf> {
    let non_empty = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    let root = non_empty("KILN_CACHE_DIR")
        .or_else(|| non_empty("XDG_CACHE_HOME").map(|d| d.join("kiln")))
        .or_else(|| non_empty("HOME").map(|d| d.join(".cache").join("kiln")))
        .ok_or_else(|| Error::BadSetting {
            name: "KILN_CACHE_DIR",
            value: String::new(),
            allowed: "a directory (neither KILN_CACHE_DIR, XDG_CACHE_HOME nor HOME is set)",
        })?;
    Ok(root.join("tuning"))
}

/// A certificate file: which directory (by position), its path relative to it, and its bytes.
#[derive(Debug)]
pub struct CertificateFile {
    pub dir_position: usize,
    pub relative: String,
    pub path: PathBuf,
    pub contents: Vec<u8>,
}

/// Every `<kernel>/<name>.json` under `dirs`, in directory order then name order.
pub fn certificate_files(dirs: &[PathBuf]) -> Result<Vec<CertificateFile>> {
    let mut files = Vec::new();
    for (dir_position, dir) in dirs.iter().enumerate() {
        let kernels = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(dir, e)),
        };
        let mut found = Vec::new();
        for kernel in kernels {
            let kernel = kernel.map_err(|e| Error::io(dir, e))?.path();
            if !kernel.is_dir() {
                continue;
            }
            for entry in std::fs::read_dir(&kernel).map_err(|e| Error::io(&kernel, e))? {
                let path = entry.map_err(|e| Error::io(&kernel, e))?.path();
                if path.extension().is_some_and(|x| x == "json") && path.is_file() {
                    found.push(path);
                }
            }
        }
        found.sort();
        for path in found {
            let relative = path.strip_prefix(dir).unwrap_or(&path).to_string_lossy().replace('\\', "/");
            let contents = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
            files.push(CertificateFile { dir_position, relative, path, contents });
        }
    }
    Ok(files)
}

/// The SHA-256 (hex) of the files' directory positions, names and contents, each length-prefixed.
pub fn fingerprint(files: &[CertificateFile]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"kiln tuning certificates v1");
    for file in files {
        hasher.update((file.dir_position as u64).to_le_bytes());
        hasher.update((file.relative.len() as u64).to_le_bytes());
        hasher.update(file.relative.as_bytes());
        hasher.update((file.contents.len() as u64).to_le_bytes());
        hasher.update(&file.contents);
    }
    hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses and validates one certificate file, checking that it sits where its key says.
pub fn parse_certificate(path: &Path, contents: &[u8]) -> Result<Certificate> {
    let refuse = |reason: String| Error::TuningStore { path: path.to_path_buf(), reason };
    let certificate: Certificate =
        serde_json::from_slice(contents).map_err(|e| refuse(format!("not a certificate: {e}")))?;
    certificate.validate().map_err(refuse)?;
    let expected_name = certificate.key.file_name();
    let kernel_dir = path.parent().and_then(Path::file_name).map(|n| n.to_string_lossy().into_owned());
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    if name.as_deref() != Some(expected_name.as_str())
        || kernel_dir.as_deref() != Some(certificate.key.kernel.as_str())
    {
        return Err(refuse(format!(
            "a certificate for {} belongs at {}/{}",
            certificate.key, certificate.key.kernel, expected_name
        )));
    }
    Ok(certificate)
}

/// Every certificate under `dirs`, parsed and validated, in directory then name order.
pub fn load_certificates(dirs: &[PathBuf]) -> Result<Vec<Certificate>> {
    certificate_files(dirs)?.iter().map(|f| parse_certificate(&f.path, &f.contents)).collect()
}

/// Writes `certificate` under `dir`. If a certificate for its key is already there, the new proof
/// becomes the current one and the older is kept as an alternate ([`Certificate::reprove`]).
/// Returns the file's path.
pub fn record_certificate(dir: &Path, certificate: Certificate) -> Result<PathBuf> {
    certificate.validate().map_err(|reason| Error::TuningStore { path: dir.to_path_buf(), reason })?;
    let path = dir.join(&certificate.key.kernel).join(certificate.key.file_name());
    let merged = match std::fs::read(&path) {
        Ok(existing) => parse_certificate(&path, &existing)?.reprove(certificate)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => certificate,
        Err(e) => return Err(Error::io(&path, e)),
    };
    let mut json = serde_json::to_vec_pretty(&merged)
        .map_err(|e| Error::TuningStore { path: path.clone(), reason: format!("cannot encode: {e}") })?;
    json.push(b'\n');
    write_atomically(&path, &json)?;
    Ok(path)
}

/// Writes `bytes` to a temporary file beside `path`, then renames it into place, so a reader sees
/// the old file or the new one, never half of one.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(format!(".{}.tmp", std::process::id()));
    let temporary = PathBuf::from(temporary);
    std::fs::write(&temporary, bytes).map_err(|e| Error::io(&temporary, e))?;
    std::fs::rename(&temporary, path).map_err(|e| Error::io(path, e))
}
