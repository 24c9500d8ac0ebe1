//! GPU tests of the RoPE kernel: every variant, layout, dtype and frequency scaling, with and
//! without Qwen3's q/k RMSNorm, equal to the CPU reference (`kiln_core::ops::rope`) bit for bit,
//! on fresh random inputs over ragged shapes, with guard bytes after q and k that must stay
//! untouched. Needs an NVIDIA GPU: `cargo test -p kiln-cuda --features gpu-tests --test gpu_rope`.

use kiln_core::ops::primitives::FloatType;
use kiln_core::ops::rope::{
    apply_rope_typed, qk_norm_rope_typed, RopeLayout, RopeScaling, RopeSpec, RopeTable,
};
use kiln_core::DType;
use kiln_cuda::ops::embedding::read_flag;
use kiln_cuda::ops::rope::{
    rope, DeviceRopeTable, QkNorm, RopeBuffers, RopeCall, RopeVariant, ROPE_VARIANTS,
};
use kiln_cuda::{DeviceMemory, Gpu};

mod common;
use common::Rng;

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in [lo, hi), rounded to `ty`.
    fn values(&mut self, len: usize, lo: f32, hi: f32, ty: FloatType) -> Vec<f32> {
        (0..len)
            .map(|_| ty.round(lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)))
            .collect()
    }
}

const GUARD_BYTES: usize = 256;
const POISON: u8 = 0xA7;

fn encode(values: &[f32], ty: FloatType) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * ty.bytes());
    for &v in values {
        ty.encode(v, &mut out);
    }
    out
}

fn upload(gpu: &Gpu, bytes: &[u8]) -> DeviceMemory {
    let memory = gpu.alloc(bytes.len().max(4)).expect("device allocation");
    memory.copy_from_host(0, bytes).expect("host to device copy");
    memory
}

/// `bytes` followed by poisoned guard bytes.
fn upload_guarded(gpu: &Gpu, bytes: &[u8]) -> DeviceMemory {
    let memory = gpu.alloc(bytes.len() + GUARD_BYTES).expect("device allocation");
    memory.fill_bytes(POISON).expect("poison");
    memory.copy_from_host(0, bytes).expect("host to device copy");
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

/// The reference on the CPU: each token's q heads and k heads at its position.
#[allow(clippy::too_many_arguments)]
fn reference(
    values: &mut [f32],
    heads: usize,
    call: &RopeCall,
    positions: &[u32],
    weight: &[f32],
    ty: FloatType,
) {
    let per_token = heads * call.head_dim;
    if per_token == 0 {
        return;
    }
    for (token, chunk) in values.chunks_mut(per_token).enumerate() {
        let position = u64::from(positions[token]);
        match call.qk_norm {
            Some(n) => {
                qk_norm_rope_typed(chunk, call.head_dim, heads, position, weight, n.eps, &call.spec, ty)
            }
            None => apply_rope_typed(chunk, call.head_dim, heads, position, &call.spec, ty),
        }
        .expect("CPU reference");
    }
}

/// Runs one call on the GPU and the CPU; positions are drawn below `table.positions`, or, with
/// `outside`, some of them at or past it (those tokens must come back zero and set the flag).
fn check(
    gpu: &Gpu,
    rng: &mut Rng,
    call: RopeCall,
    variant: RopeVariant,
    table: &(RopeTable, DeviceRopeTable),
    outside: bool,
) {
    let xt = FloatType::of(call.x_type, "test").unwrap();
    let wt = FloatType::of(call.qk_norm.map_or(DType::F32, |n| n.weight_type), "test").unwrap();
    let (host_table, device_table) = table;
    let limit = host_table.positions as u64;
    let mut positions: Vec<u32> = (0..call.tokens).map(|_| rng.below(limit) as u32).collect();
    if outside {
        for p in positions.iter_mut() {
            if rng.below(3) == 0 {
                *p = [limit as u32, limit as u32 + 1 + rng.below(1000) as u32, u32::MAX]
                    [rng.below(3) as usize];
            }
        }
    }
    let hd = call.head_dim;
    let q = rng.values(call.tokens * call.q_heads * hd, -2.0, 2.0, xt);
    let k = rng.values(call.tokens * call.k_heads * hd, -2.0, 2.0, xt);
    let q_weight = rng.values(hd, 0.25, 1.75, wt);
    let k_weight = rng.values(hd, 0.25, 1.75, wt);

    let mut want_q = q.clone();
    let mut want_k = k.clone();
    let (in_table, zeroed): (Vec<u32>, Vec<bool>) =
        positions.iter().map(|&p| if u64::from(p) < limit { (p, false) } else { (0, true) }).unzip();
    reference(&mut want_q, call.q_heads, &call, &in_table, &q_weight, xt);
    reference(&mut want_k, call.k_heads, &call, &in_table, &k_weight, xt);
    for (token, &z) in zeroed.iter().enumerate() {
        if z {
            want_q[token * call.q_heads * hd..(token + 1) * call.q_heads * hd].fill(0.0);
            want_k[token * call.k_heads * hd..(token + 1) * call.k_heads * hd].fill(0.0);
        }
    }
    let want_flag = zeroed.iter().any(|&z| z);
    assert_eq!(want_flag, outside, "positions outside the table were drawn exactly when asked for");

    let dq = upload_guarded(gpu, &encode(&q, xt));
    let dk = upload_guarded(gpu, &encode(&k, xt));
    let dpos = upload(gpu, &positions.iter().flat_map(|p| p.to_le_bytes()).collect::<Vec<u8>>());
    let dqw = upload(gpu, &encode(&q_weight, wt));
    let dkw = upload(gpu, &encode(&k_weight, wt));
    let flag = gpu.alloc(4).expect("flag");
    flag.fill_bytes(0).expect("clear flag");
    let norm = call.qk_norm.is_some();
    let buffers = RopeBuffers {
        q: &dq,
        k: (call.k_heads > 0).then_some(&dk),
        positions: &dpos,
        table: device_table,
        q_norm_weight: norm.then_some(&dqw),
        k_norm_weight: (norm && call.k_heads > 0).then_some(&dkw),
        flag: &flag,
    };
    let label = format!("{call:?} {variant:?}");
    rope(gpu, &call, buffers, Some(variant)).unwrap_or_else(|e| panic!("{label}: {e}"));
    gpu.synchronize().unwrap_or_else(|e| panic!("{label}: {e}"));
    assert_bytes(&label, "q", &encode(&want_q, xt), &dq);
    assert_bytes(&label, "k", &encode(&want_k, xt), &dk);
    assert_eq!(read_flag(&flag).unwrap(), want_flag, "{label}: out-of-table flag");
}

fn spec(layout: RopeLayout, rotary_dim: usize, scaling: RopeScaling) -> RopeSpec {
    RopeSpec { layout, rotary_dim, theta: 1_000_000.0, scaling }
}

fn table(gpu: &Gpu, spec: RopeSpec, head_dim: usize, positions: usize) -> (RopeTable, DeviceRopeTable) {
    let host = RopeTable::new(spec, head_dim, positions).expect("table");
    let device = DeviceRopeTable::upload(gpu, &host).expect("table upload");
    (host, device)
}

/// (tokens, q heads, k heads, head size, rotary dim): rows 1 to 8192, heads of 256 and 512
/// elements and of sizes that are not multiples of 256, full and partial rotary dims (some whose
/// half is not a multiple of 8, so pairs cross lanes unaligned).
const SHAPES: &[(usize, usize, usize, usize, usize)] = &[
    (1, 32, 8, 128, 128),
    (7, 16, 2, 64, 64),
    (8192, 2, 1, 128, 128),
    (129, 5, 3, 80, 32),
    (33, 4, 0, 96, 24),
    (3, 8, 4, 256, 64),
    (17, 3, 1, 512, 512),
    (2, 2, 2, 1024, 1000),
    (300, 12, 4, 136, 132),
    (1000, 1, 1, 8, 6),
];

#[test]
fn every_variant_layout_and_norm_matches_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let mut tested = 0;
    for &(tokens, q_heads, k_heads, head_dim, rotary_dim) in SHAPES {
        for layout in [RopeLayout::HalfSplit, RopeLayout::Interleaved] {
            let s = spec(layout, rotary_dim, RopeScaling::None);
            let t = table(&gpu, s, head_dim, 4096);
            for qk_norm in [None, Some(QkNorm { eps: 1e-6, weight_type: DType::BF16 })] {
                let call =
                    RopeCall { spec: s, tokens, q_heads, k_heads, head_dim, x_type: DType::BF16, qk_norm };
                for &variant in ROPE_VARIANTS {
                    if call.validate(variant).is_ok() {
                        check(&gpu, &mut rng, call, variant, &t, false);
                        tested += 1;
                    }
                }
            }
        }
    }
    assert!(tested >= ROPE_VARIANTS.len() * 4, "only {tested} variant/shape pairs served");
}

#[test]
fn every_dtype_and_scaling_matches_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let scalings = [
        RopeScaling::None,
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192.0,
        },
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position: 32_768.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: RopeScaling::yarn_attention_factor(4.0),
            truncate: true,
        },
    ];
    let types = [DType::BF16, DType::F16, DType::F32];
    for scaling in scalings {
        for &(tokens, q_heads, k_heads, head_dim, rotary_dim) in
            &[(37usize, 8usize, 2usize, 128usize, 128usize), (5, 4, 4, 256, 64), (64, 3, 1, 80, 32)]
        {
            for layout in [RopeLayout::HalfSplit, RopeLayout::Interleaved] {
                let s = spec(layout, rotary_dim, scaling);
                let t = table(&gpu, s, head_dim, 65_536);
                for (i, &x_type) in types.iter().enumerate() {
                    for qk_norm in [None, Some(QkNorm { eps: 1e-6, weight_type: types[(i + 1) % 3] })] {
                        let call = RopeCall { spec: s, tokens, q_heads, k_heads, head_dim, x_type, qk_norm };
                        let variant = RopeVariant::default_for(head_dim);
                        check(&gpu, &mut rng, call, variant, &t, false);
                        let other =
                            ROPE_VARIANTS.iter().rev().find(|v| **v != variant && call.validate(**v).is_ok());
                        check(&gpu, &mut rng, call, *other.expect("a second variant"), &t, false);
                    }
                }
            }
        }
    }
}

#[test]
fn positions_outside_the_table_zero_the_token_and_set_the_flag() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    for (head_dim, rotary_dim) in [(128, 128), (128, 64)] {
        let s = spec(RopeLayout::HalfSplit, rotary_dim, RopeScaling::None);
        let t = table(&gpu, s, head_dim, 100);
        for qk_norm in [None, Some(QkNorm { eps: 1e-6, weight_type: DType::BF16 })] {
            let call = RopeCall {
                spec: s,
                tokens: 64,
                q_heads: 4,
                k_heads: 2,
                head_dim,
                x_type: DType::BF16,
                qk_norm,
            };
            for &variant in ROPE_VARIANTS.iter().filter(|v| call.validate(**v).is_ok()) {
                check(&gpu, &mut rng, call, variant, &t, true);
            }
        }
    }
}

#[test]
fn a_table_of_another_spec_is_refused() {
    let gpu = gpu();
    let s = spec(RopeLayout::HalfSplit, 64, RopeScaling::None);
    let (_, device_table) = table(&gpu, s, 64, 16);
    let other = RopeSpec { theta: 10_000.0, ..s };
    let call = RopeCall {
        spec: other,
        tokens: 1,
        q_heads: 1,
        k_heads: 0,
        head_dim: 64,
        x_type: DType::BF16,
        qk_norm: None,
    };
    let (q, positions, flag) = (upload(&gpu, &[0; 128]), upload(&gpu, &[0; 4]), upload(&gpu, &[0; 4]));
    let buffers = RopeBuffers {
        q: &q,
        k: None,
        positions: &positions,
        table: &device_table,
        q_norm_weight: None,
        k_norm_weight: None,
        flag: &flag,
    };
    assert!(matches!(
        rope(&gpu, &call, buffers, None),
        Err(kiln_core::Error::InvalidArgument { name: "rope table", .. })
    ));
}
