//! GPU tests of the embedding kernel: every variant, table type (bf16, fp16, fp32, Q8_0) and
//! output type, with and without row sums of squares, equal to the CPU reference
//! (`kiln_core::ops::embedding`) bit for bit, on fresh random tables and ids over ragged shapes,
//! with outputs poisoned and guard bytes that must stay untouched; ids outside the vocabulary give
//! zero rows and set the flag. Needs an NVIDIA GPU: `cargo test -p kiln-cuda --features gpu-tests
//! --test gpu_embedding`.

use kiln_core::ops::embedding::EmbeddingTable;
use kiln_core::ops::primitives::{f32_to_f16_bits, FloatType};
use kiln_core::DType;
use kiln_cuda::ops::embedding::{
    embedding, read_flag, EmbeddingBuffers, EmbeddingCall, EmbeddingVariant, EMBEDDING_VARIANTS,
};
use kiln_cuda::{DeviceMemory, Gpu};

mod common;
use common::Rng;

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const GUARD_BYTES: usize = 256;
const POISON: u8 = 0xA7;

/// A random table of `vocab x hidden` values as stored in `dtype`.
fn random_table(rng: &mut Rng, dtype: DType, vocab: usize, hidden: usize) -> Vec<u8> {
    let mut bytes = Vec::new();
    match dtype {
        DType::Q8_0 => {
            for _ in 0..vocab * hidden / 32 {
                let scale = rng.uniform(1e-4, 0.05);
                bytes.extend_from_slice(&f32_to_f16_bits(scale).to_le_bytes());
                bytes.extend((0..32).map(|_| rng.next() as u8));
            }
        }
        other => {
            let ty = FloatType::of(other, "test").unwrap();
            for _ in 0..vocab * hidden {
                let v = rng.uniform(-3.0, 3.0);
                ty.encode(v, &mut bytes);
            }
        }
    }
    bytes
}

fn upload(gpu: &Gpu, bytes: &[u8]) -> DeviceMemory {
    let memory = gpu.alloc(bytes.len().max(4)).expect("device allocation");
    memory.copy_from_host(0, bytes).expect("host to device copy");
    memory
}

fn poisoned(gpu: &Gpu, bytes: usize) -> DeviceMemory {
    let memory = gpu.alloc(bytes + GUARD_BYTES).expect("device allocation");
    memory.fill_bytes(POISON).expect("poison");
    memory
}

fn assert_bytes(label: &str, what: &str, want: &[u8], memory: &DeviceMemory) {
    let got = memory.to_host_bytes().expect("device to host copy");
    if let Some(i) = want.iter().zip(&got).position(|(a, b)| a != b) {
        panic!("{label}: {what} byte {i} differs: want {:#04x}, got {:#04x}", want[i], got[i]);
    }
    if let Some(i) = got[want.len()..].iter().position(|&b| b != POISON) {
        panic!("{label}: {what} guard byte {i} was written");
    }
}

fn gpu() -> std::sync::Arc<Gpu> {
    Gpu::open(0).expect("these tests need a CUDA GPU (device 0)")
}

/// A vocabulary that keeps the table under about 64 MB.
fn vocab_for(hidden: usize) -> usize {
    (16_000_000 / hidden).clamp(3, 5000)
}

/// Runs one lookup on the GPU and the CPU and asserts the bytes are equal; with `outside`, some
/// ids are at or past the vocabulary.
fn check(gpu: &Gpu, rng: &mut Rng, call: EmbeddingCall, variant: EmbeddingVariant, outside: bool) {
    let table = random_table(rng, call.table_type, call.vocab, call.hidden);
    let vocab = call.vocab as u64;
    let ids: Vec<u32> = (0..call.rows)
        .map(|_| {
            if outside && rng.below(4) == 0 {
                [vocab as u32, (vocab + 1 + rng.below(1 << 20)) as u32, u32::MAX][rng.below(3) as usize]
            } else {
                rng.below(vocab) as u32
            }
        })
        .collect();
    let reference =
        EmbeddingTable { bytes: &table, dtype: call.table_type, vocab: call.vocab, hidden: call.hidden };
    let want = reference.lookup(&ids, call.out_type, call.sum_squares).expect("CPU reference");
    let out_type = FloatType::of(call.out_type, "test").unwrap();
    let mut want_out = Vec::new();
    for &v in &want.values {
        out_type.encode(v, &mut want_out);
    }

    let (_, out_bytes, sum_bytes) = call.buffer_bytes().unwrap();
    let dids = upload(gpu, &ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>());
    let dtable = upload(gpu, &table);
    let dout = poisoned(gpu, out_bytes);
    let dsums = poisoned(gpu, sum_bytes);
    let flag = gpu.alloc(4).expect("flag");
    flag.fill_bytes(0).expect("clear flag");
    let buffers = EmbeddingBuffers {
        ids: &dids,
        table: &dtable,
        out: &dout,
        sum_squares: call.sum_squares.then_some(&dsums),
        flag: &flag,
    };
    let label = format!("{call:?} {variant:?}");
    embedding(gpu, &call, buffers, Some(variant)).unwrap_or_else(|e| panic!("{label}: {e}"));
    gpu.synchronize().unwrap_or_else(|e| panic!("{label}: {e}"));
    assert_bytes(&label, "out", &want_out, &dout);
    match &want.sum_squares {
        Some(sums) => {
            let bytes: Vec<u8> = sums.iter().flat_map(|s| s.to_le_bytes()).collect();
            assert_bytes(&label, "sum_squares", &bytes, &dsums);
        }
        None => assert_bytes(&label, "sum_squares", &[], &dsums),
    }
    assert_eq!(read_flag(&flag).unwrap(), want.out_of_vocabulary, "{label}: out-of-vocabulary flag");
    if outside {
        assert!(want.out_of_vocabulary, "{label}: no id outside the vocabulary was drawn");
    }
}

/// Ragged shapes: rows 1 to 8192, hidden sizes that are and are not multiples of 256, up to 16384
/// (those of Q8_0 tables multiples of 32).
const SHAPES: &[(usize, usize)] = &[
    (1, 4096),
    (3, 1000),
    (7, 32),
    (64, 2080),
    (5, 16_384),
    (8192, 256),
    (129, 4104),
    (2, 8192),
    (33, 16_352),
    (4000, 576),
];

#[test]
fn every_variant_matches_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let mut tested = 0;
    for &variant in EMBEDDING_VARIANTS {
        for &(rows, hidden) in SHAPES {
            for (table_type, out_type) in [(DType::BF16, DType::F32), (DType::Q8_0, DType::BF16)] {
                let call = EmbeddingCall {
                    rows,
                    vocab: vocab_for(hidden),
                    hidden,
                    table_type,
                    out_type,
                    sum_squares: rng.below(4) != 0,
                };
                if call.validate(variant).is_ok() {
                    check(&gpu, &mut rng, call, variant, false);
                    tested += 1;
                }
            }
        }
    }
    assert!(tested >= EMBEDDING_VARIANTS.len() * SHAPES.len(), "only {tested} variant/shape pairs served");
}

#[test]
fn every_table_and_output_type_matches_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    for table_type in [DType::BF16, DType::F16, DType::F32, DType::Q8_0] {
        for out_type in [DType::BF16, DType::F16, DType::F32] {
            for sum_squares in [false, true] {
                for &(rows, hidden) in &[(3usize, 1024usize), (17, 4128), (2, 16_384), (300, 96)] {
                    let call = EmbeddingCall {
                        rows,
                        vocab: vocab_for(hidden),
                        hidden,
                        table_type,
                        out_type,
                        sum_squares,
                    };
                    let variant = EmbeddingVariant::default_for(hidden);
                    check(&gpu, &mut rng, call, variant, false);
                    let other = EMBEDDING_VARIANTS.iter().rev().find(|v| **v != variant);
                    check(&gpu, &mut rng, call, *other.expect("a second variant"), false);
                }
            }
        }
    }
}

#[test]
fn ids_outside_the_vocabulary_give_zero_rows_and_set_the_flag() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    for &variant in EMBEDDING_VARIANTS {
        for table_type in [DType::BF16, DType::Q8_0] {
            let call = EmbeddingCall {
                rows: 257,
                vocab: 1000,
                hidden: 2080,
                table_type,
                out_type: DType::F32,
                sum_squares: true,
            };
            check(&gpu, &mut rng, call, variant, true);
        }
    }
}
