use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use sha2::{Digest, Sha256};

use super::index::{decode, encode};
use super::store::{
    certificate_files, fingerprint, load_certificates, parse_certificate, record_certificate,
};
use super::*;

/// A directory under the system's temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(label: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kiln-tuning-{label}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn key(shape: &str) -> TuningKey {
    TuningKey::new("rms_norm", shape, "bf16", "sm_90").unwrap()
}

fn generator(version: &str) -> Generator {
    Generator { kiln_version: version.into(), source_sha256: format!("{:0>64}", version.len()) }
}

fn wrong(config: &str, time_us: f64) -> CandidateResult {
    CandidateResult {
        config: config.into(),
        time_us: Some(time_us),
        error: Some(1.0),
        status: CandidateStatus::WrongResult { detail: "max error 1 > 0".into() },
    }
}

fn failed(config: &str) -> CandidateResult {
    CandidateResult {
        config: config.into(),
        time_us: None,
        error: None,
        status: CandidateStatus::Failed { detail: "out of shared memory".into() },
    }
}

fn certificate(shape: &str, version: &str, times: &[(&str, f64)]) -> Certificate {
    let candidates = times.iter().map(|&(c, t)| CandidateResult::ok(c, t, 0.0)).collect();
    Certificate::new(key(shape), candidates, generator(version), "NVIDIA H200", "580.65", "2026-11-30")
        .unwrap()
}

// ---- keys --------------------------------------------------------------------------------------

#[test]
fn key_displays_as_a_stable_string_and_names_its_file() {
    let k = TuningKey::new("lm_head", "rows_le_8.v49152", "q4_1.f32", "sm_90").unwrap();
    assert_eq!(k.to_string(), "lm_head/rows_le_8.v49152/q4_1.f32/sm_90");
    assert_eq!(k.file_name(), "rows_le_8.v49152@q4_1.f32@sm_90.json");
}

#[test]
fn key_with_a_path_separator_or_empty_part_is_refused() {
    for (kernel, shape) in [("rms/norm", "h1"), ("rms_norm", ""), ("rms_norm", ".."), ("rms_norm", "a b")] {
        let err = TuningKey::new(kernel, shape, "bf16", "sm_90").unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { name: "tuning key", .. }), "{kernel} {shape}: {err}");
    }
}

// ---- selection ---------------------------------------------------------------------------------

#[test]
fn a_faster_wrong_or_failed_candidate_is_never_chosen() {
    let candidates = vec![
        CandidateResult::ok("slow", 20.0, 0.0),
        wrong("fast_but_wrong", 1.0),
        failed("did_not_fit"),
        CandidateResult::ok("fast", 10.0, 0.0),
        CandidateResult {
            config: "nan_time".into(),
            time_us: Some(f64::NAN),
            error: Some(0.0),
            status: CandidateStatus::Ok,
        },
    ];
    assert_eq!(select_winner(&key("h576"), &candidates).unwrap().config, "fast");
}

#[test]
fn no_correct_candidate_is_a_named_error() {
    let candidates = vec![wrong("a", 1.0), failed("b")];
    match select_winner(&key("h576"), &candidates) {
        Err(Error::NoCorrectCandidate { key, candidates }) => {
            assert_eq!(key, "rms_norm/h576/bf16/sm_90");
            assert_eq!(candidates, 2);
        }
        other => panic!("expected NoCorrectCandidate, got {other:?}"),
    }
    assert!(matches!(select_winner(&key("h576"), &[]), Err(Error::NoCorrectCandidate { candidates: 0, .. })));
}

fn arbitrary_candidate() -> impl Strategy<Value = CandidateResult> {
    // 0: correct, 1: wrong (often faster than any correct one), 2: failed.
    (0u8..3, 0.0f64..100.0, 0u32..1000).prop_map(|(kind, time_us, id)| match kind {
        0 => CandidateResult::ok(format!("ok{id}"), time_us, 0.0),
        1 => wrong(&format!("wrong{id}"), time_us / 10.0),
        _ => failed(&format!("failed{id}")),
    })
}

proptest! {
    #[test]
    fn winner_is_correct_and_fastest_among_correct(candidates in prop::collection::vec(arbitrary_candidate(), 0..24)) {
        let correct: Vec<&CandidateResult> =
            candidates.iter().filter(|c| c.status == CandidateStatus::Ok).collect();
        match select_winner(&key("h576"), &candidates) {
            Ok(winner) => {
                prop_assert_eq!(&winner.status, &CandidateStatus::Ok);
                let winner_time = winner.time_us.unwrap();
                for c in &correct {
                    prop_assert!(winner_time <= c.time_us.unwrap());
                }
            }
            Err(Error::NoCorrectCandidate { candidates: n, .. }) => {
                prop_assert!(correct.is_empty());
                prop_assert_eq!(n, candidates.len());
            }
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }
}

// ---- certificates ------------------------------------------------------------------------------

#[test]
fn certificate_json_names_every_field() {
    let mut c = certificate("h576", "0.1.0", &[("warps4", 12.5)]);
    c.candidates.push(wrong("warps8", 3.0));
    let json: serde_json::Value = serde_json::to_value(&c).unwrap();
    assert_eq!(json["key"]["kernel"], "rms_norm");
    assert_eq!(json["winner"], "warps4");
    assert_eq!(json["candidates"][0]["time_us"], 12.5);
    assert_eq!(json["candidates"][0]["status"]["kind"], "ok");
    assert_eq!(json["candidates"][1]["status"]["kind"], "wrong_result");
    assert_eq!(json["candidates"][1]["status"]["detail"], "max error 1 > 0");
    assert_eq!(json["generator"]["kiln_version"], "0.1.0");
    assert_eq!(json["gpu"], "NVIDIA H200");
    let back: Certificate = serde_json::from_value(json).unwrap();
    assert_eq!(back, c);
}

#[test]
fn certificate_whose_winner_is_wrong_or_not_fastest_is_refused() {
    let mut c = certificate("h576", "0.1.0", &[("a", 10.0), ("b", 5.0)]);
    assert_eq!(c.winner, "b");
    c.winner = "a".into();
    assert!(c.validate().unwrap_err().contains("slower than correct candidate `b`"));
    c.candidates.push(wrong("w", 1.0));
    c.winner = "w".into();
    assert!(c.validate().unwrap_err().contains("was not a correct run"));
    c.winner = "absent".into();
    assert!(c.validate().unwrap_err().contains("not among the candidates"));
}

#[test]
fn reproof_under_a_new_generator_keeps_the_older_as_alternates() {
    let first = certificate("h576", "0.1.0", &[("a", 10.0)]);
    let second = certificate("h576", "0.2.0", &[("a", 10.0), ("b", 8.0)]);
    let third = certificate("h576", "0.3.0", &[("b", 7.0)]);
    let merged = first.clone().reprove(second.clone()).unwrap().reprove(third.clone()).unwrap();
    assert_eq!(merged.generator.kiln_version, "0.3.0");
    assert_eq!(merged.winner, "b");
    let versions: Vec<&str> = merged.alternates.iter().map(|p| p.generator.kiln_version.as_str()).collect();
    assert_eq!(versions, ["0.2.0", "0.1.0"]);
    assert_eq!(merged.alternates[1], first.proof());

    // Same generator: a re-measurement replaces the proof and adds no alternate.
    let remeasured = certificate("h576", "0.3.0", &[("b", 6.5)]);
    let merged = merged.reprove(remeasured).unwrap();
    assert_eq!(merged.candidates[0].time_us, Some(6.5));
    assert_eq!(merged.alternates.len(), 2);

    let other_key = certificate("h4096", "0.4.0", &[("a", 1.0)]);
    assert!(matches!(first.reprove(other_key), Err(Error::InvalidArgument { name: "re-proof", .. })));
}

// ---- index -------------------------------------------------------------------------------------

fn entries() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("rms_norm/h576/bf16/sm_90".to_string(), "warps4".to_string()),
        ("lm_head/v49152/q4_1.f32/sm_90".to_string(), "xslot.pipe".to_string()),
    ])
}

fn reason(err: Error, path: &Path) -> String {
    match err {
        Error::TuningStore { path: p, reason } => {
            assert_eq!(p, path);
            reason
        }
        other => panic!("expected TuningStore, got {other:?}"),
    }
}

#[test]
fn index_layout_is_the_documented_one() {
    let one = BTreeMap::from([("k".to_string(), "win".to_string())]);
    let mut expected = b"KILNTUNE".to_vec();
    expected.extend_from_slice(&[1, 0, 0, 0, 1, 0, 0, 0]);
    expected.extend_from_slice(&[1, 0, 0, 0, b'k', 3, 0, 0, 0, b'w', b'i', b'n']);
    let digest = Sha256::digest(&expected);
    expected.extend_from_slice(&digest);
    assert_eq!(encode(&one).unwrap(), expected);
    assert_eq!(decode(Path::new("x.index"), &expected).unwrap(), one);
}

#[test]
fn index_round_trips() {
    let bytes = encode(&entries()).unwrap();
    assert_eq!(decode(Path::new("x.index"), &bytes).unwrap(), entries());
    let empty = encode(&BTreeMap::new()).unwrap();
    assert!(decode(Path::new("x.index"), &empty).unwrap().is_empty());
}

#[test]
fn index_with_bad_magic_is_refused_by_name() {
    let path = Path::new("/store/abc.index");
    let mut bytes = encode(&entries()).unwrap();
    bytes[0] = b'X';
    assert!(reason(decode(path, &bytes).unwrap_err(), path).contains("bad magic"));
}

#[test]
fn index_truncated_at_every_byte_is_refused_by_name() {
    let path = Path::new("/store/abc.index");
    let bytes = encode(&entries()).unwrap();
    for len in 0..bytes.len() {
        let err = decode(path, &bytes[..len]).unwrap_err();
        let r = reason(err, path);
        assert!(
            r.contains("bad magic") || r.contains("truncated") || r.contains("trailer"),
            "length {len}: {r}"
        );
    }
}

#[test]
fn index_with_any_byte_flipped_is_refused_by_name() {
    let path = Path::new("/store/abc.index");
    let bytes = encode(&entries()).unwrap();
    for i in 0..bytes.len() {
        let mut corrupt = bytes.clone();
        corrupt[i] ^= 0x20;
        let r = reason(decode(path, &corrupt).unwrap_err(), path);
        assert!(r.contains("bad magic") || r.contains("trailer"), "byte {i}: {r}");
    }
}

/// An index body with a correct trailer, to reach the rules past the trailer check.
fn sealed(body: &[u8]) -> Vec<u8> {
    let mut bytes = body.to_vec();
    let digest = Sha256::digest(body);
    bytes.extend_from_slice(&digest);
    bytes
}

#[test]
fn index_breaking_a_layout_rule_under_a_valid_trailer_is_refused() {
    let path = Path::new("/store/abc.index");
    let header = |version: u32, count: u32| {
        let mut b = b"KILNTUNE".to_vec();
        b.extend_from_slice(&version.to_le_bytes());
        b.extend_from_slice(&count.to_le_bytes());
        b
    };
    let entry = |k: &[u8], w: &[u8]| {
        let mut b = (k.len() as u32).to_le_bytes().to_vec();
        b.extend_from_slice(k);
        b.extend_from_slice(&(w.len() as u32).to_le_bytes());
        b.extend_from_slice(w);
        b
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (header(2, 0), "unsupported version 2"),
        (header(1, u32::MAX), "cannot fit"),
        ([header(1, 1), entry(b"k", b"w"), vec![0]].concat(), "1 bytes after the last entry"),
        ([header(1, 2), entry(b"k", b"w"), entry(b"k", b"v")].concat(), "duplicate key `k`"),
        ([header(1, 1), entry(b"k", &[0xff, 0xfe])].concat(), "entry 0 winner is not UTF-8"),
        ([header(1, 1), entry(b"", b"w")].concat(), "entry 0 key: length 0"),
        ([header(1, 1), (999u32).to_le_bytes().to_vec(), b"kkkk".to_vec()].concat(), "truncated at byte 20"),
    ];
    for (body, expected) in cases {
        let r = reason(decode(path, &sealed(&body)).unwrap_err(), path);
        assert!(r.contains(expected), "expected `{expected}` in `{r}`");
    }
}

// ---- store -------------------------------------------------------------------------------------

fn write_raw(dir: &Path, c: &Certificate) -> PathBuf {
    let path = dir.join(&c.key.kernel).join(c.key.file_name());
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, serde_json::to_vec_pretty(c).unwrap()).unwrap();
    path
}

#[test]
fn store_builds_its_index_named_by_fingerprint_and_reads_it_back() {
    let root = TempDir::new("build");
    let certs = root.0.join("certificates");
    write_raw(&certs, &certificate("h576", "0.1.0", &[("warps4", 3.0), ("warps8", 4.0)]));
    write_raw(&certs, &certificate("h4096", "0.1.0", &[("warps4", 9.0), ("warps8", 5.0)]));
    let dirs = [certs.clone()];
    let index_dir = root.0.join("index");

    let store = TuningStore::open(&dirs, &index_dir, TuningMode::Default).unwrap();
    let expected_name = format!("{}.index", fingerprint(&certificate_files(&dirs).unwrap()));
    assert_eq!(store.index_path(), index_dir.join(&expected_name));
    assert_eq!(store.winner(&key("h576")), Some("warps4"));
    assert_eq!(store.winner(&key("h4096")), Some("warps8"));
    let on_disk = decode(store.index_path(), &std::fs::read(store.index_path()).unwrap()).unwrap();
    assert_eq!(on_disk.get("rms_norm/h4096/bf16/sm_90").map(String::as_str), Some("warps8"));

    // The index, not the JSON, answers the second open: a planted entry in a valid index shows.
    let mut planted = on_disk.clone();
    planted.insert("rms_norm/h1/bf16/sm_90".into(), "from_index".into());
    std::fs::write(store.index_path(), encode(&planted).unwrap()).unwrap();
    let again = TuningStore::open(&dirs, &index_dir, TuningMode::Default).unwrap();
    assert_eq!(again.winner(&key("h1")), Some("from_index"));
}

#[test]
fn corrupt_index_is_refused_by_name_then_rebuilt() {
    let root = TempDir::new("corrupt");
    let certs = root.0.join("certificates");
    write_raw(&certs, &certificate("h576", "0.1.0", &[("warps4", 3.0)]));
    let dirs = [certs];
    let index_dir = root.0.join("index");
    let index_path =
        TuningStore::open(&dirs, &index_dir, TuningMode::Default).unwrap().index_path().to_owned();
    let good = std::fs::read(&index_path).unwrap();

    for corrupt in [b"NOTANINDEX".to_vec(), good[..good.len() - 1].to_vec(), {
        let mut b = good.clone();
        b[20] ^= 1;
        b
    }] {
        std::fs::write(&index_path, &corrupt).unwrap();
        let refused = decode(&index_path, &std::fs::read(&index_path).unwrap()).unwrap_err();
        assert!(matches!(&refused, Error::TuningStore { path, .. } if *path == index_path), "{refused}");
        let store = TuningStore::open(&dirs, &index_dir, TuningMode::Strict).unwrap();
        assert_eq!(store.winner(&key("h576")), Some("warps4"));
        assert_eq!(std::fs::read(&index_path).unwrap(), good, "the index is rebuilt in place");
    }
}

#[test]
fn fingerprint_changes_when_a_certificate_changes() {
    let root = TempDir::new("fingerprint");
    let certs = root.0.join("certificates");
    let dirs = [certs.clone()];
    let empty = fingerprint(&certificate_files(&dirs).unwrap());
    let path = write_raw(&certs, &certificate("h576", "0.1.0", &[("warps4", 3.0)]));
    let one = fingerprint(&certificate_files(&dirs).unwrap());
    assert_ne!(empty, one);
    assert_eq!(one, fingerprint(&certificate_files(&dirs).unwrap()), "stable when nothing changes");

    write_raw(&certs, &certificate("h576", "0.1.0", &[("warps4", 3.5)]));
    let edited = fingerprint(&certificate_files(&dirs).unwrap());
    assert_ne!(one, edited);

    // Same bytes under another name is another fingerprint too.
    let contents = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::write(path.with_file_name("other.json"), contents).unwrap();
    assert_ne!(edited, fingerprint(&certificate_files(&dirs).unwrap()));

    // And the store follows the change: a new index, with the new winner.
    std::fs::remove_file(path.with_file_name("other.json")).unwrap();
    let index_dir = root.0.join("index");
    write_raw(&certs, &certificate("h576", "0.1.0", &[("warps4", 3.0), ("warps8", 4.0)]));
    let before = TuningStore::open(&dirs, &index_dir, TuningMode::Default).unwrap();
    write_raw(&certs, &certificate("h576", "0.1.0", &[("warps4", 3.0), ("warps8", 2.0)]));
    let after = TuningStore::open(&dirs, &index_dir, TuningMode::Default).unwrap();
    assert_ne!(before.index_path(), after.index_path());
    assert_eq!(before.winner(&key("h576")), Some("warps4"));
    assert_eq!(after.winner(&key("h576")), Some("warps8"));
}

#[test]
fn strict_mode_miss_names_kernel_and_key_default_mode_runs_the_default() {
    let root = TempDir::new("strict");
    let certs = root.0.join("certificates");
    write_raw(&certs, &certificate("h576", "0.1.0", &[("warps4", 3.0)]));
    let dirs = [certs];
    let index_dir = root.0.join("index");

    let strict = TuningStore::open(&dirs, &index_dir, TuningMode::Strict).unwrap();
    assert_eq!(strict.config_for(&key("h576"), "warps1").unwrap(), "warps4");
    match strict.config_for(&key("h4096"), "warps1") {
        Err(Error::KeyNotCertified { kernel, key }) => {
            assert_eq!(kernel, "rms_norm");
            assert_eq!(key, "rms_norm/h4096/bf16/sm_90");
        }
        other => panic!("expected KeyNotCertified, got {other:?}"),
    }

    let lenient = TuningStore::open(&dirs, &index_dir, TuningMode::Default).unwrap();
    assert_eq!(lenient.config_for(&key("h4096"), "warps1").unwrap(), "warps1");
    assert_eq!(lenient.config_for(&key("h576"), "warps1").unwrap(), "warps4");
}

#[test]
fn tuning_mode_accepts_strict_and_default_only() {
    assert_eq!(TuningMode::parse(None).unwrap(), TuningMode::Default);
    assert_eq!(TuningMode::parse(Some("")).unwrap(), TuningMode::Default);
    assert_eq!(TuningMode::parse(Some("default")).unwrap(), TuningMode::Default);
    assert_eq!(TuningMode::parse(Some("strict")).unwrap(), TuningMode::Strict);
    for bad in ["Strict", "on", "1", "strict "] {
        match TuningMode::parse(Some(bad)) {
            Err(Error::BadSetting { name: "KILN_TUNING", value, .. }) => assert_eq!(value, bad),
            other => panic!("{bad}: expected BadSetting, got {other:?}"),
        }
    }
}

#[test]
fn a_later_directory_overrides_an_earlier_one() {
    let root = TempDir::new("override");
    let shipped = root.0.join("shipped");
    let local = root.0.join("local");
    write_raw(&shipped, &certificate("h576", "0.1.0", &[("shipped_winner", 3.0)]));
    write_raw(&shipped, &certificate("h4096", "0.1.0", &[("only_shipped", 3.0)]));
    write_raw(&local, &certificate("h576", "0.1.0", &[("local_winner", 2.0)]));
    let store = TuningStore::open(&[shipped, local], &root.0.join("index"), TuningMode::Default).unwrap();
    assert_eq!(store.winner(&key("h576")), Some("local_winner"));
    assert_eq!(store.winner(&key("h4096")), Some("only_shipped"));
}

#[test]
fn malformed_or_misplaced_certificate_is_refused_by_path() {
    let root = TempDir::new("malformed");
    let certs = root.0.join("certificates");
    let path = certs.join("rms_norm").join("h576@bf16@sm_90.json");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, b"{ not json").unwrap();
    let err = TuningStore::open(std::slice::from_ref(&certs), &root.0.join("index"), TuningMode::Default)
        .unwrap_err();
    assert!(reason(err, &path).contains("not a certificate"));

    let c = certificate("h4096", "0.1.0", &[("a", 1.0)]);
    let err = parse_certificate(&path, &serde_json::to_vec(&c).unwrap()).unwrap_err();
    assert!(reason(err, &path).contains("belongs at rms_norm/h4096@bf16@sm_90.json"));

    let mut not_fastest = certificate("h576", "0.1.0", &[("a", 1.0), ("b", 2.0)]);
    not_fastest.winner = "b".into();
    let err = parse_certificate(&path, &serde_json::to_vec(&not_fastest).unwrap()).unwrap_err();
    assert!(reason(err, &path).contains("slower than correct candidate `a`"));
}

#[test]
fn recording_a_reproof_keeps_the_older_proof_in_the_file() {
    let root = TempDir::new("record");
    let certs = root.0.join("certificates");
    let first = certificate("h576", "0.1.0", &[("a", 10.0)]);
    let path = record_certificate(&certs, first.clone()).unwrap();
    assert_eq!(path, certs.join("rms_norm").join("h576@bf16@sm_90.json"));
    record_certificate(&certs, certificate("h576", "0.2.0", &[("a", 10.0), ("b", 4.0)])).unwrap();

    let loaded = load_certificates(&[certs]).unwrap();
    assert_eq!(loaded.len(), 1);
    assert_eq!(loaded[0].winner, "b");
    assert_eq!(loaded[0].generator.kiln_version, "0.2.0");
    assert_eq!(loaded[0].alternates, vec![first.proof()]);
}
