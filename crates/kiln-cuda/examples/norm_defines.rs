//! Prints the compile-time constants of the norm kernel that `kiln bench norm` runs for one of its
//! cases (RMSNorm, Llama's rounding, bf16 x and weight; or its LayerNorm, with weight and bias) on
//! the case's default variant, as
//! `NAME=VALUE` words for `scripts/sass-loops norm ARCH ...` (see `scripts/sass-fast-path`). No
//! GPU and no NVRTC needed.
//!
//! `cargo run --release -p kiln-cuda --example norm_defines -- ROWS HIDDEN bf16|int8|nvfp4|layer`

use kiln_core::ops::norm::{LayerNorm, NormOutput, NormSpec, RmsNorm, WeightMode};
use kiln_core::ops::quantize::Quantizer;
use kiln_core::{DType, Error, Result};
use kiln_cuda::ops::norm::{NormCall, NormVariant};

const USAGE: &str = "usage: norm_defines ROWS HIDDEN bf16|int8|nvfp4|layer";

fn count(args: &[String], at: usize, name: &'static str) -> Result<usize> {
    let text = args.get(at).map_or("", String::as_str);
    text.parse().map_err(|_| Error::InvalidArgument { name, value: text.to_owned(), reason: USAGE.into() })
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (rows, hidden) = (count(&args, 0, "ROWS")?, count(&args, 1, "HIDDEN")?);
    let llama = RmsNorm::llama(1e-5, DType::BF16);
    let spec: NormSpec = match args.get(2).map_or("", String::as_str) {
        "bf16" => llama.into(),
        "int8" => RmsNorm { out: NormOutput::Quantized(Quantizer::Int8), ..llama }.into(),
        "nvfp4" => {
            RmsNorm { out: NormOutput::Quantized(Quantizer::Nvfp4 { global_scale: 448.0 }), ..llama }.into()
        }
        // `kiln bench norm`'s layer_norm case.
        "layer" => LayerNorm {
            eps: 1e-5,
            weight: WeightMode::Plain,
            bias: true,
            groups: 1,
            out: NormOutput::Float(DType::BF16),
        }
        .into(),
        other => {
            return Err(Error::InvalidArgument { name: "OUT", value: other.to_owned(), reason: USAGE.into() })
        }
    };
    let call = NormCall { spec, rows, hidden, x_type: DType::BF16, weight_type: DType::BF16 };
    let defines = call.defines(NormVariant::default_for(&call))?;
    let words: Vec<String> = defines.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("{}", words.join(" "));
    Ok(())
}
