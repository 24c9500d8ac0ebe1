//! The GGUF reader against malformed files: one case per rule, each asserting the specific
//! error it must produce, plus truncation at every byte and random mutations.
//!
//! The cases are built here, byte by byte; `tests/corpus/gguf/` holds the same files (written with
//! `KILN_WRITE_CORPUS=1`, checked to be identical otherwise) for the fuzz targets to start from.

use std::path::PathBuf;

use kiln_core::{DType, Error, GgufErrorKind};
use kiln_engine::formats::{GgufArray, GgufFile, GgufValue};
use proptest::prelude::*;

// ---- a byte-level GGUF writer ------------------------------------------------------------------

const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;

#[derive(Clone)]
struct Kv {
    key: Vec<u8>,
    value_type: u32,
    value: Vec<u8>,
}

#[derive(Clone)]
struct TensorInfo {
    name: Vec<u8>,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
}

#[derive(Clone)]
struct Gguf {
    magic: [u8; 4],
    version: u32,
    tensor_count: Option<u64>,
    kv_count: Option<u64>,
    kvs: Vec<Kv>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data: Vec<u8>,
}

fn s(text: &[u8]) -> Vec<u8> {
    let mut v = (text.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(text);
    v
}

fn kv(key: &str, value_type: u32, value: Vec<u8>) -> Kv {
    Kv { key: key.as_bytes().to_vec(), value_type, value }
}

fn array(element_type: u32, count: u64, elements: &[u8]) -> Vec<u8> {
    let mut v = element_type.to_le_bytes().to_vec();
    v.extend_from_slice(&count.to_le_bytes());
    v.extend_from_slice(elements);
    v
}

fn tensor(name: &str, dims: &[u64], dtype: DType, offset: u64) -> TensorInfo {
    TensorInfo {
        name: name.as_bytes().to_vec(),
        dims: dims.to_vec(),
        type_id: dtype.gguf_code().unwrap(),
        offset,
    }
}

impl Gguf {
    /// A small valid file: every scalar type, string and number arrays, a nested array, and two
    /// tensors (an F32 4×2 and one Q4_0 block).
    fn valid() -> Gguf {
        let strings: Vec<u8> = [&b"a"[..], b"bc", b""].iter().flat_map(|t| s(t)).collect();
        let i32s: Vec<u8> = [1i32, -2, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        let inner = array(T_U8, 2, &[7, 8]);
        let nested = array(T_ARRAY, 1, &inner);
        let mut data: Vec<u8> = (0..8).flat_map(|i| (i as f32 * 0.5).to_le_bytes()).collect();
        // One Q4_0 block: scale 1.0 (f16 0x3c00), quants 0..15.
        data.extend_from_slice(&[0x00, 0x3c]);
        data.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        Gguf {
            magic: *b"GGUF",
            version: 3,
            tensor_count: None,
            kv_count: None,
            kvs: vec![
                kv("general.architecture", T_STRING, s(b"llama")),
                kv("general.alignment", T_U32, 32u32.to_le_bytes().to_vec()),
                kv("test.u8", T_U8, vec![200]),
                kv("test.i8", T_I8, vec![0xff]),
                kv("test.i32", T_I32, (-5i32).to_le_bytes().to_vec()),
                kv("test.u64", T_U64, (1u64 << 40).to_le_bytes().to_vec()),
                kv("test.i64", T_I64, 12i64.to_le_bytes().to_vec()),
                kv("test.f32", T_F32, 0.25f32.to_le_bytes().to_vec()),
                kv("test.bool", T_BOOL, vec![1]),
                kv("test.strings", T_ARRAY, array(T_STRING, 3, &strings)),
                kv("test.i32s", T_ARRAY, array(T_I32, 3, &i32s)),
                kv("test.nested", T_ARRAY, nested),
            ],
            tensors: vec![tensor("a", &[4, 2], DType::F32, 0), tensor("b", &[32], DType::Q4_0, 32)],
            alignment: 32,
            data,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut v = self.magic.to_vec();
        v.extend_from_slice(&self.version.to_le_bytes());
        v.extend_from_slice(&self.tensor_count.unwrap_or(self.tensors.len() as u64).to_le_bytes());
        v.extend_from_slice(&self.kv_count.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for kv in &self.kvs {
            v.extend_from_slice(&s(&kv.key));
            v.extend_from_slice(&kv.value_type.to_le_bytes());
            v.extend_from_slice(&kv.value);
        }
        for t in &self.tensors {
            v.extend_from_slice(&s(&t.name));
            v.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                v.extend_from_slice(&d.to_le_bytes());
            }
            v.extend_from_slice(&t.type_id.to_le_bytes());
            v.extend_from_slice(&t.offset.to_le_bytes());
        }
        while !(v.len() as u64).is_multiple_of(self.alignment) {
            v.push(0);
        }
        v.extend_from_slice(&self.data);
        v
    }

    fn with(mut self, change: impl FnOnce(&mut Gguf)) -> Gguf {
        change(&mut self);
        self
    }

    fn set(self, key: &str, value_type: u32, value: Vec<u8>) -> Gguf {
        self.with(|g| {
            let at = g.kvs.iter().position(|k| k.key == key.as_bytes()).unwrap();
            g.kvs[at] = kv(key, value_type, value);
        })
    }
}

fn parse(bytes: Vec<u8>) -> Result<GgufFile, Error> {
    GgufFile::from_bytes(bytes, "case.gguf")
}

fn kind_of(bytes: Vec<u8>) -> GgufErrorKind {
    match parse(bytes) {
        Err(Error::Gguf { kind, .. }) => kind,
        Err(other) => panic!("expected a GGUF error, got {other}"),
        Ok(_) => panic!("a malformed file was accepted"),
    }
}

// ---- the valid file ----------------------------------------------------------------------------

#[test]
fn the_valid_file_reads_back_every_value() {
    for version in [2, 3] {
        let file = parse(Gguf::valid().with(|g| g.version = version).bytes()).unwrap();
        assert_eq!(file.version(), version);
        assert_eq!(file.alignment(), 32);
        assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(file.get_u32("test.u8").unwrap(), 200);
        assert_eq!(file.get_u64("test.u64").unwrap(), 1 << 40);
        assert_eq!(file.get_u32("test.i64").unwrap(), 12);
        assert_eq!(file.get_i32("test.i32").unwrap(), -5);
        assert_eq!(file.get_f32("test.f32").unwrap(), 0.25);
        assert!(file.get_bool("test.bool").unwrap());
        assert_eq!(file.get_string_array("test.strings").unwrap(), &["a", "bc", ""]);
        assert_eq!(file.get_i32_array("test.i32s").unwrap(), &[1, -2, 3]);
        assert_eq!(
            file.get("test.nested"),
            Some(&GgufValue::Array(GgufArray::Array(vec![GgufArray::U8(vec![7, 8])])))
        );
        assert_eq!(file.get("test.i8"), Some(&GgufValue::I8(-1)));
        assert_eq!(file.opt_u32("absent").unwrap(), None);

        let names: Vec<&str> = file.tensor_names().collect();
        assert_eq!(names, ["a", "b"]);
        let a = file.tensor_info("a").unwrap();
        assert_eq!((a.dims.clone(), a.dtype, a.bytes), (vec![4, 2], DType::F32, 32));
        assert_eq!(a.offset % 32, 0);
        let t = file.tensor("a").unwrap();
        assert_eq!(t.shape(), &[2, 4]);
        assert_eq!(t.to_f32_vec().unwrap(), (0..8).map(|i| i as f32 * 0.5).collect::<Vec<_>>());
        let b = file.tensor_bytes("b").unwrap();
        assert_eq!(b.len(), 18);
        assert_eq!(&b[..2], &[0x00, 0x3c]);
        assert!(matches!(file.tensor_bytes("c"), Err(Error::MissingTensor { .. })));
    }
}

#[test]
fn a_file_without_tensors_or_alignment_reads() {
    let g = Gguf::valid().with(|g| {
        g.tensors.clear();
        g.data.clear();
        g.kvs.retain(|k| k.key != b"general.alignment");
    });
    let file = parse(g.bytes()).unwrap();
    assert_eq!(file.alignment(), 32);
    assert_eq!(file.tensor_infos().len(), 0);
}

// ---- getters -----------------------------------------------------------------------------------

#[test]
fn getters_name_wrong_types_missing_keys_and_values_out_of_range() {
    let file = parse(Gguf::valid().bytes()).unwrap();
    let kind = |e: Error| match e {
        Error::Gguf { kind, .. } => kind,
        other => panic!("{other}"),
    };
    assert_eq!(
        kind(file.get_u32("general.architecture").unwrap_err()),
        GgufErrorKind::WrongType {
            key: "general.architecture".into(),
            expected: "u32",
            found: "string".into()
        }
    );
    assert_eq!(
        kind(file.get_string_array("test.i32s").unwrap_err()),
        GgufErrorKind::WrongType {
            key: "test.i32s".into(),
            expected: "array<string>",
            found: "array<i32>".into()
        }
    );
    assert_eq!(
        kind(file.opt_f32("test.strings").unwrap_err()),
        GgufErrorKind::WrongType {
            key: "test.strings".into(),
            expected: "f32",
            found: "array<string>".into()
        }
    );
    assert_eq!(kind(file.get_str("nope").unwrap_err()), GgufErrorKind::MissingKey { key: "nope".into() });
    assert_eq!(
        kind(file.get_u32("test.i32").unwrap_err()),
        GgufErrorKind::ValueOutOfRange { key: "test.i32".into(), value: "-5".into(), expected: "u32" }
    );
    assert_eq!(
        kind(file.get_u32("test.u64").unwrap_err()),
        GgufErrorKind::ValueOutOfRange {
            key: "test.u64".into(),
            value: (1u64 << 40).to_string(),
            expected: "u32"
        }
    );
    assert_eq!(
        kind(file.opt_u64("test.i8").unwrap_err()),
        GgufErrorKind::ValueOutOfRange { key: "test.i8".into(), value: "-1".into(), expected: "u64" }
    );
}

// ---- one case per rule -------------------------------------------------------------------------

/// Every malformed case: its corpus name, its bytes, and the error it must produce.
fn cases() -> Vec<(&'static str, Vec<u8>, GgufErrorKind)> {
    let v = Gguf::valid;
    let bad_tensor =
        |name: &str, reason: &str| GgufErrorKind::BadTensor { name: name.into(), reason: reason.into() };
    let bad_offset = |name: &str, start, end, reason| GgufErrorKind::BadOffset {
        name: String::from(name),
        start,
        end,
        reason,
    };
    let nested = |depth: usize| {
        let mut value = array(T_U8, 1, &[1]);
        for _ in 1..depth {
            value = array(T_ARRAY, 1, &value);
        }
        value
    };
    let mut garbage = v().bytes();
    garbage[0] = b'G';
    garbage[1..4].copy_from_slice(b"GML");
    let mut past_end = v().bytes();
    past_end.truncate(past_end.len() - 1);
    let mut trailing = v().bytes();
    trailing.extend_from_slice(&[0u8; 64]);
    vec![
        ("bad_magic", garbage, GgufErrorKind::BadMagic { found: *b"GGML" }),
        ("version_1", v().with(|g| g.version = 1).bytes(), GgufErrorKind::UnsupportedVersion { version: 1 }),
        ("version_4", v().with(|g| g.version = 4).bytes(), GgufErrorKind::UnsupportedVersion { version: 4 }),
        (
            "tensor_count_max",
            v().with(|g| g.tensor_count = Some(u64::MAX)).bytes(),
            GgufErrorKind::AbsurdCount {
                what: "tensor",
                count: u64::MAX,
                file_bytes: v().bytes().len() as u64,
            },
        ),
        (
            "metadata_count_max",
            v().with(|g| g.kv_count = Some(u64::MAX)).bytes(),
            GgufErrorKind::AbsurdCount {
                what: "metadata",
                count: u64::MAX,
                file_bytes: v().bytes().len() as u64,
            },
        ),
        (
            "metadata_count_too_large",
            v().with(|g| g.kv_count = Some(1000)).bytes(),
            GgufErrorKind::AbsurdCount {
                what: "metadata",
                count: 1000,
                file_bytes: v().bytes().len() as u64,
            },
        ),
        (
            "string_past_end",
            v().set("general.architecture", T_STRING, (1u64 << 40).to_le_bytes().to_vec()).bytes(),
            GgufErrorKind::Truncated { what: String::new(), needed: 0, available: 0 },
        ),
        (
            "key_not_utf8",
            v().with(|g| g.kvs[2].key = vec![b't', 0xff, 0xfe]).bytes(),
            GgufErrorKind::NotUtf8 { what: "metadata key".into() },
        ),
        (
            "value_not_utf8",
            v().set("general.architecture", T_STRING, s(&[0xc3, 0x28])).bytes(),
            GgufErrorKind::NotUtf8 { what: "value of `general.architecture`".into() },
        ),
        (
            "tensor_name_not_utf8",
            v().with(|g| g.tensors[0].name = vec![0x80]).bytes(),
            GgufErrorKind::NotUtf8 { what: "tensor name".into() },
        ),
        (
            "unknown_value_type",
            v().set("test.u8", 13, vec![0; 8]).bytes(),
            GgufErrorKind::UnknownValueType { key: "test.u8".into(), code: 13 },
        ),
        (
            "unknown_array_element_type",
            v().set("test.u8", T_ARRAY, array(99, 1, &[0])).bytes(),
            GgufErrorKind::UnknownValueType { key: "test.u8".into(), code: 99 },
        ),
        (
            "nested_too_deep",
            v().set("test.nested", T_ARRAY, nested(5)).bytes(),
            GgufErrorKind::NestingTooDeep { key: "test.nested".into(), limit: 4 },
        ),
        (
            "array_count_max",
            v().set("test.i32s", T_ARRAY, array(T_I32, u64::MAX, &[])).bytes(),
            GgufErrorKind::AbsurdCount {
                what: "array element",
                count: u64::MAX,
                file_bytes: v().set("test.i32s", T_ARRAY, array(T_I32, u64::MAX, &[])).bytes().len() as u64,
            },
        ),
        (
            "bool_not_0_or_1",
            v().set("test.bool", T_BOOL, vec![2]).bytes(),
            GgufErrorKind::BadBool { key: "test.bool".into(), value: 2 },
        ),
        (
            "duplicate_key",
            v().with(|g| g.kvs.push(kv("test.u8", T_U8, vec![1]))).bytes(),
            GgufErrorKind::DuplicateKey { key: "test.u8".into() },
        ),
        (
            "duplicate_tensor",
            v().with(|g| g.tensors[1].name = b"a".to_vec()).bytes(),
            GgufErrorKind::DuplicateTensor { name: "a".into() },
        ),
        (
            "alignment_zero",
            v().set("general.alignment", T_U32, 0u32.to_le_bytes().to_vec()).bytes(),
            GgufErrorKind::BadAlignment { value: 0, reason: "zero" },
        ),
        (
            "alignment_not_power_of_two",
            v().set("general.alignment", T_U32, 48u32.to_le_bytes().to_vec()).bytes(),
            GgufErrorKind::BadAlignment { value: 48, reason: "not a power of two" },
        ),
        (
            "alignment_huge",
            v().set("general.alignment", T_U32, (1u32 << 31).to_le_bytes().to_vec()).bytes(),
            GgufErrorKind::BadAlignment { value: 1 << 31, reason: "larger than 65536" },
        ),
        (
            "alignment_wrong_type",
            v().set("general.alignment", T_STRING, s(b"32")).bytes(),
            GgufErrorKind::WrongType {
                key: "general.alignment".into(),
                expected: "u32",
                found: "string".into(),
            },
        ),
        (
            "five_dims",
            v().with(|g| g.tensors[0].dims = vec![4, 2, 1, 1, 1]).bytes(),
            bad_tensor("a", "5 dimensions (GGML allows 1 to 4)"),
        ),
        (
            "no_dims",
            v().with(|g| g.tensors[0].dims = vec![]).bytes(),
            bad_tensor("a", "0 dimensions (GGML allows 1 to 4)"),
        ),
        (
            "zero_dim",
            v().with(|g| g.tensors[0].dims = vec![4, 0]).bytes(),
            bad_tensor("a", "dimension 1 is 0"),
        ),
        (
            "negative_dim",
            v().with(|g| g.tensors[0].dims = vec![4, (-2i64) as u64]).bytes(),
            bad_tensor("a", "dimension 1 is -2"),
        ),
        (
            "element_count_overflow",
            v().with(|g| g.tensors[0].dims = vec![1 << 32, 1 << 32, 1 << 32]).bytes(),
            bad_tensor("a", "element count of dims [4294967296, 4294967296, 4294967296] overflows"),
        ),
        (
            "byte_size_overflow",
            v().with(|g| g.tensors[0].dims = vec![1 << 62]).bytes(),
            bad_tensor("a", "byte size of 4611686018427387904 F32 elements overflows"),
        ),
        (
            "unknown_tensor_type",
            v().with(|g| g.tensors[0].type_id = 99).bytes(),
            GgufErrorKind::UnknownTensorType { name: "a".into(), type_id: 99 },
        ),
        (
            "first_dim_not_block_multiple",
            v().with(|g| g.tensors[1].dims = vec![16, 2]).bytes(),
            bad_tensor("b", "first dimension 16 is not a multiple of the Q4_0 block size 32"),
        ),
        (
            "offset_misaligned",
            v().with(|g| g.tensors[1].offset = 40).bytes(),
            bad_offset("b", 40, 58, "is not aligned to general.alignment"),
        ),
        (
            "offsets_overlap",
            v().with(|g| g.tensors[1].offset = 0).bytes(),
            bad_offset("b", 0, 18, "overlaps the previous tensor"),
        ),
        (
            "offsets_leave_a_gap",
            v().with(|g| {
                g.tensors[1].offset = 64;
                g.data.splice(32..32, [0u8; 32]);
            })
            .bytes(),
            bad_offset("b", 64, 82, "leaves a gap after the previous tensor"),
        ),
        (
            "first_tensor_not_at_zero",
            v().with(|g| {
                g.tensors[0].offset = 32;
                g.tensors[1].offset = 64;
                g.data.splice(0..0, [0u8; 32]);
            })
            .bytes(),
            bad_offset("a", 32, 64, "leaves a gap after the previous tensor"),
        ),
        ("data_past_end", past_end, bad_offset("b", 32, 50, "runs past the end of the file")),
        (
            "offset_past_end",
            v().with(|g| g.tensors[1].offset = 1 << 40).bytes(),
            bad_offset("b", 1 << 40, (1 << 40) + 18, "leaves a gap after the previous tensor"),
        ),
        ("trailing_bytes", trailing, GgufErrorKind::TrailingBytes { bytes: 64, alignment: 32 }),
    ]
}

#[test]
fn every_malformed_case_gets_its_named_error() {
    for (name, bytes, want) in cases() {
        let got = kind_of(bytes);
        match (&got, &want) {
            // Truncation messages carry byte counts that depend on the layout; the rule is the point.
            (GgufErrorKind::Truncated { .. }, GgufErrorKind::Truncated { .. }) => {}
            _ => assert_eq!(got, want, "case {name}"),
        }
    }
}

#[test]
fn nesting_up_to_the_cap_reads() {
    let mut value = array(T_U8, 1, &[1]);
    for _ in 1..4 {
        value = array(T_ARRAY, 1, &value);
    }
    let file = parse(Gguf::valid().set("test.nested", T_ARRAY, value).bytes()).unwrap();
    assert!(matches!(file.get("test.nested"), Some(GgufValue::Array(GgufArray::Array(_)))));
}

#[test]
fn errors_locate_the_fault() {
    // The duplicate key is the 13th entry; the offset points at its start.
    let bytes = Gguf::valid().with(|g| g.kvs.push(kv("test.u8", T_U8, vec![1]))).bytes();
    // Magic, version and the two counts (24 bytes), then the 12 valid entries.
    let header_end_of_kvs =
        24 + Gguf::valid().kvs.iter().map(|k| 8 + k.key.len() + 4 + k.value.len()).sum::<usize>() as u64;
    match parse(bytes) {
        Err(Error::Gguf { offset, path, .. }) => {
            assert_eq!(offset, header_end_of_kvs);
            assert_eq!(path, PathBuf::from("case.gguf"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn truncation_at_every_byte_is_a_named_error() {
    let bytes = Gguf::valid().bytes();
    for len in 0..bytes.len() {
        match kind_of(bytes[..len].to_vec()) {
            GgufErrorKind::Truncated { .. } | GgufErrorKind::AbsurdCount { .. } => {}
            GgufErrorKind::BadOffset { reason: "runs past the end of the file", .. } => {}
            other => panic!("truncated to {len} bytes: unexpected {other}"),
        }
    }
}

#[test]
fn the_corpus_on_disk_is_the_cases() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/gguf");
    let mut all = cases();
    all.push(("valid", Gguf::valid().bytes(), GgufErrorKind::MissingKey { key: String::new() }));
    if std::env::var_os("KILN_WRITE_CORPUS").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes, _) in &all {
            std::fs::write(dir.join(format!("{name}.gguf")), bytes).unwrap();
        }
    }
    for (name, bytes, _) in &all {
        let path = dir.join(format!("{name}.gguf"));
        let on_disk = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (regenerate with KILN_WRITE_CORPUS=1)", path.display()));
        assert_eq!(&on_disk, bytes, "{} differs from its case", path.display());
    }
    let files = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(files, all.len(), "{} holds files that are not cases", dir.display());
}

#[test]
fn open_reads_the_same_as_from_bytes() {
    let path = std::env::temp_dir().join(format!("kiln-gguf-{}.gguf", std::process::id()));
    std::fs::write(&path, Gguf::valid().bytes()).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.tensor("a").unwrap().to_f32_vec().unwrap()[3], 1.5);
    drop(file);
    std::fs::remove_file(&path).unwrap();
    match GgufFile::open(&path) {
        Err(Error::Io { path: p, .. }) => assert_eq!(p, path),
        other => panic!("{other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Random byte changes, insertions and cuts of the valid file never panic: each is read or
    /// refused with an error.
    #[test]
    fn random_mutations_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..8),
    ) {
        let mut bytes = Gguf::valid().bytes();
        for (at, byte, op) in edits {
            if bytes.is_empty() {
                break;
            }
            let i = at.index(bytes.len());
            match op {
                0 => bytes[i] = byte,
                1 => bytes.insert(i, byte),
                2 => { bytes.remove(i); }
                _ => bytes[i] ^= 0x80,
            }
        }
        if let Ok(file) = parse(bytes) {
            for name in file.tensor_names().map(str::to_string).collect::<Vec<_>>() {
                let _ = file.tensor(&name);
            }
        }
    }
}
