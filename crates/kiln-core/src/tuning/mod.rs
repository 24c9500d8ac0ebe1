//! Certified tuning: which configuration of a kernel runs for a key, and the proof of why.
//!
//! A kernel family declares a [`TuningKey`] (shape class, dtypes, architecture) and its candidate
//! configurations. A certifier (run on the device) measures each candidate and checks it against
//! the oracle; this module holds what it produces and how it is chosen and stored:
//!
//! - [`CandidateResult`]: one candidate's label, time, error against the oracle and [`CandidateStatus`];
//! - [`select_winner`]: the fastest candidate whose result was correct. A wrong or failed candidate
//!   scores infinity and is never chosen; when none is correct the answer is
//!   [`Error::NoCorrectCandidate`];
//! - [`Certificate`]: the key, the winner, every candidate's result and the [`Proof`]'s provenance
//!   (generator, GPU, driver, date), with older proofs kept as alternates;
//! - [`store`]: certificates as JSON files, a validated binary index, and strict mode.
//!
//! ```
//! use kiln_core::tuning::{select_winner, CandidateResult, CandidateStatus, TuningKey};
//! let key = TuningKey::new("rms_norm", "h576", "bf16", "sm_90")?;
//! let candidates = vec![
//!     CandidateResult::ok("warps4", 12.0, 0.0),
//!     CandidateResult { config: "warps8".into(), time_us: Some(9.0), error: Some(0.5),
//!                       status: CandidateStatus::WrongResult { detail: "error 0.5 > 0".into() } },
//!     CandidateResult::ok("warps2", 10.0, 0.0),
//! ];
//! assert_eq!(select_winner(&key, &candidates)?.config, "warps2");
//! # Ok::<(), kiln_core::Error>(())
//! ```

pub mod index;
pub mod store;

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

pub use store::{TuningMode, TuningStore};

/// What a tuned kernel's choice depends on. Each part is a plain token (ASCII letters, digits and
/// `_ - . = , +`) so that the key is a stable string and a file name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TuningKey {
    /// The kernel family, e.g. `rms_norm`.
    pub kernel: String,
    /// The class of shapes the choice holds for, e.g. `h576` or `rows_le_64.h4096`.
    pub shape_class: String,
    /// The element types, e.g. `bf16` or `q4_1.f32`.
    pub dtypes: String,
    /// The architecture, e.g. `sm_90`.
    pub arch: String,
}

impl TuningKey {
    /// A key whose parts are checked to be plain tokens.
    pub fn new(
        kernel: impl Into<String>,
        shape_class: impl Into<String>,
        dtypes: impl Into<String>,
        arch: impl Into<String>,
    ) -> Result<TuningKey> {
        let key = TuningKey {
            kernel: kernel.into(),
            shape_class: shape_class.into(),
            dtypes: dtypes.into(),
            arch: arch.into(),
        };
        key.validate()?;
        Ok(key)
    }

    /// Checks that every part is a non-empty plain token.
    pub fn validate(&self) -> Result<()> {
        for (name, value) in [
            ("kernel", &self.kernel),
            ("shape_class", &self.shape_class),
            ("dtypes", &self.dtypes),
            ("arch", &self.arch),
        ] {
            let plain = |c: char| c.is_ascii_alphanumeric() || "_-.=,+".contains(c);
            if value.is_empty() || value.len() > 128 || !value.chars().all(plain) || value.starts_with('.') {
                return Err(Error::InvalidArgument {
                    name: "tuning key",
                    value: format!("{name} = {value:?}"),
                    reason: "each part must be 1 to 128 of ASCII letters, digits and `_ - . = , +`, \
                             not starting with `.`"
                        .into(),
                });
            }
        }
        Ok(())
    }

    /// The certificate's file name inside its kernel's directory: `<shape_class>@<dtypes>@<arch>.json`.
    pub fn file_name(&self) -> String {
        format!("{}@{}@{}.json", self.shape_class, self.dtypes, self.arch)
    }
}

/// `kernel/shape_class/dtypes/arch`, the string the index stores.
impl fmt::Display for TuningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}/{}", self.kernel, self.shape_class, self.dtypes, self.arch)
    }
}

/// How a candidate's run went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CandidateStatus {
    /// It ran and its output agreed with the oracle.
    Ok,
    /// It ran and its output disagreed with the oracle.
    WrongResult { detail: String },
    /// It did not compile, launch or finish (out of memory, a launch error).
    Failed { detail: String },
}

/// One candidate configuration's measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CandidateResult {
    /// The variant's label, e.g. `warps4.rows2.early_weight`.
    pub config: String,
    /// The median time in microseconds, when it ran.
    pub time_us: Option<f64>,
    /// The largest error against the oracle, when it ran.
    pub error: Option<f64>,
    pub status: CandidateStatus,
}

impl CandidateResult {
    /// A candidate that ran correctly in `time_us` with `error` against the oracle.
    pub fn ok(config: impl Into<String>, time_us: f64, error: f64) -> CandidateResult {
        CandidateResult {
            config: config.into(),
            time_us: Some(time_us),
            error: Some(error),
            status: CandidateStatus::Ok,
        }
    }

    /// The time the selection rule ranks by: the measured time of a correct run, infinity for a
    /// run that was wrong, failed, or has no finite non-negative time.
    pub fn score_us(&self) -> f64 {
        match (&self.status, self.time_us) {
            (CandidateStatus::Ok, Some(t)) if t.is_finite() && t >= 0.0 => t,
            _ => f64::INFINITY,
        }
    }

    /// Whether the selection rule may choose this candidate.
    pub fn is_eligible(&self) -> bool {
        self.score_us().is_finite()
    }
}

/// The fastest candidate whose result was correct; the first listed wins a tie. A wrong or failed
/// candidate is never chosen: with no correct candidate the answer is [`Error::NoCorrectCandidate`].
pub fn select_winner<'a>(key: &TuningKey, candidates: &'a [CandidateResult]) -> Result<&'a CandidateResult> {
    let mut best: Option<&CandidateResult> = None;
    for candidate in candidates.iter().filter(|c| c.is_eligible()) {
        if best.is_none_or(|b| candidate.score_us() < b.score_us()) {
            best = Some(candidate);
        }
    }
    best.ok_or_else(|| Error::NoCorrectCandidate { key: key.to_string(), candidates: candidates.len() })
}

/// What produced a proof: Kiln's version and the SHA-256 of the kernel's source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Generator {
    pub kiln_version: String,
    pub source_sha256: String,
}

/// One measurement of every candidate for a key, and where and when it was made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proof {
    pub winner: String,
    pub candidates: Vec<CandidateResult>,
    pub generator: Generator,
    pub gpu: String,
    pub driver: String,
    /// The date of the measurement, ISO 8601 (`2026-11-30`).
    pub date: String,
}

/// The certified choice for one key: the current proof, and older proofs made under other
/// generators kept as alternates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Certificate {
    pub key: TuningKey,
    pub winner: String,
    pub candidates: Vec<CandidateResult>,
    pub generator: Generator,
    pub gpu: String,
    pub driver: String,
    pub date: String,
    #[serde(default)]
    pub alternates: Vec<Proof>,
}

impl Certificate {
    /// A certificate whose winner is chosen from `candidates` by [`select_winner`].
    pub fn new(
        key: TuningKey,
        candidates: Vec<CandidateResult>,
        generator: Generator,
        gpu: impl Into<String>,
        driver: impl Into<String>,
        date: impl Into<String>,
    ) -> Result<Certificate> {
        key.validate()?;
        let winner = select_winner(&key, &candidates)?.config.clone();
        Ok(Certificate {
            key,
            winner,
            candidates,
            generator,
            gpu: gpu.into(),
            driver: driver.into(),
            date: date.into(),
            alternates: Vec::new(),
        })
    }

    /// The current proof, without the key and alternates.
    pub fn proof(&self) -> Proof {
        Proof {
            winner: self.winner.clone(),
            candidates: self.candidates.clone(),
            generator: self.generator.clone(),
            gpu: self.gpu.clone(),
            driver: self.driver.clone(),
            date: self.date.clone(),
        }
    }

    /// Takes `newer` (a certificate for the same key) as the current proof. A proof made under a
    /// different generator is kept as an alternate; one made under the same generator is replaced
    /// (a re-measurement). The alternates of both are kept, none twice.
    pub fn reprove(self, newer: Certificate) -> Result<Certificate> {
        if newer.key != self.key {
            return Err(Error::InvalidArgument {
                name: "re-proof",
                value: newer.key.to_string(),
                reason: format!("the certificate being re-proved is for {}", self.key),
            });
        }
        let mut merged = newer;
        let mut older = self.alternates;
        if self.generator != merged.generator {
            older.insert(
                0,
                Proof {
                    winner: self.winner,
                    candidates: self.candidates,
                    generator: self.generator,
                    gpu: self.gpu,
                    driver: self.driver,
                    date: self.date,
                },
            );
        }
        for proof in older {
            if proof.generator != merged.generator && !merged.alternates.contains(&proof) {
                merged.alternates.push(proof);
            }
        }
        Ok(merged)
    }

    /// Checks what a hand-edited file could break: the key's form, and that the winner is the one
    /// [`select_winner`] picks from the candidates (a correct one, none correct being faster).
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.key.validate().map_err(|e| e.to_string())?;
        let chosen = select_winner(&self.key, &self.candidates).map_err(|e| e.to_string())?;
        let named = self.candidates.iter().find(|c| c.config == self.winner);
        match named {
            None => Err(format!("winner `{}` is not among the candidates", self.winner)),
            Some(c) if !c.is_eligible() => {
                Err(format!("winner `{}` was not a correct run ({:?})", self.winner, c.status))
            }
            Some(c) if c.score_us() > chosen.score_us() => Err(format!(
                "winner `{}` ({} us) is slower than correct candidate `{}` ({} us)",
                self.winner,
                c.score_us(),
                chosen.config,
                chosen.score_us()
            )),
            Some(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
