//! The layout of the paged KV cache in memory: what each index means and in which unit.
//!
//! The cache of one layer is two buffers, `K` and `V`, of `pages` pages each. A page holds
//! `page_tokens` consecutive positions of one sequence for every KV head:
//!
//! ```text
//! K[page][kv_head][slot][d], V[page][kv_head][slot][d]          (bf16, row-major, "HND")
//!   page     in [0, pages)        a page id of the [`PagePool`](super::PagePool)
//!   kv_head  in [0, kv_heads)
//!   slot     in [0, page_tokens)  position within the page: position = i * page_tokens + slot
//!                                 for the i-th entry of the sequence's page table
//!   d        in [0, head_dim)     element of the head vector
//! element offset = ((page * kv_heads + kv_head) * page_tokens + slot) * head_dim + d
//! ```
//!
//! With [`KvFormat::Fp8E4m3`] each element is one byte, an E4M3 code, and every row (one
//! `(page, kv_head, slot)`, `head_dim` codes) has one fp32 scale in a buffer of its own per layer
//! and per `K` / `V` (`kiln_core::ops::attention::kv_fp8_row`), at row offset
//! `(page * kv_heads + kv_head) * page_tokens + slot`.
//!
//! A token's *slot index* (the unit [`AppendPlan::slots`](super::AppendPlan) speaks in) is
//! `page * page_tokens + slot`. A page id names the same page in every layer, so one page table
//! serves the whole model. Head-major pages keep one head's `page_tokens x head_dim` block
//! contiguous: an attention tile of one head reads `page_tokens * head_dim * 2` consecutive bytes.

use kiln_core::{Error, Result};

/// The element format of the pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// bf16 values, 2 bytes per element.
    Bf16,
    /// FP8 E4M3 codes, 1 byte per element, and one fp32 scale per row of `head_dim` codes.
    Fp8E4m3,
}

impl KvFormat {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            KvFormat::Bf16 => 2,
            KvFormat::Fp8E4m3 => 1,
        }
    }

    /// Bytes of scale per row of `head_dim` elements (0 for bf16).
    pub fn scale_bytes(self) -> usize {
        match self {
            KvFormat::Bf16 => 0,
            KvFormat::Fp8E4m3 => 4,
        }
    }
}

/// The shape of the paged cache (see the module docs for the element order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Transformer layers; each has its own `K` and `V` buffers of the same page count.
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Positions per page (a power of two).
    pub page_tokens: usize,
    pub format: KvFormat,
}

impl KvLayout {
    /// A checked layout: every count nonzero, `page_tokens` a power of two.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        page_tokens: usize,
        format: KvFormat,
    ) -> Result<KvLayout> {
        for (name, value) in [("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)] {
            if value == 0 {
                return Err(Error::InvalidArgument {
                    name,
                    value: value.to_string(),
                    reason: "a KV layout needs at least one".into(),
                });
            }
        }
        if !page_tokens.is_power_of_two() {
            return Err(Error::InvalidArgument {
                name: "page_tokens",
                value: page_tokens.to_string(),
                reason: "pages hold a power of two of positions".into(),
            });
        }
        let layout = KvLayout { layers, kv_heads, head_dim, page_tokens, format };
        layout.bytes_per_page()?;
        Ok(layout)
    }

    /// Elements of one page in one buffer (one layer's `K` or `V`): `kv_heads * page_tokens *
    /// head_dim`.
    pub fn page_elements(&self) -> usize {
        self.kv_heads * self.page_tokens * self.head_dim
    }

    /// The element offset of `(page, kv_head, slot, d)` in one layer's `K` or `V` buffer.
    pub fn element_offset(&self, page: u32, kv_head: usize, slot: usize, d: usize) -> usize {
        ((page as usize * self.kv_heads + kv_head) * self.page_tokens + slot) * self.head_dim + d
    }

    /// The row offset of `(page, kv_head, slot)`: the index of its scale with FP8 pages.
    pub fn row_offset(&self, page: u32, kv_head: usize, slot: usize) -> usize {
        (page as usize * self.kv_heads + kv_head) * self.page_tokens + slot
    }

    /// Bytes of one page over all layers, `K` and `V` (with their scales).
    pub fn bytes_per_page(&self) -> Result<usize> {
        self.page_elements()
            .checked_mul(self.format.bytes())
            .and_then(|b| b.checked_add(self.kv_heads * self.page_tokens * self.format.scale_bytes()))
            .and_then(|b| b.checked_mul(2 * self.layers))
            .ok_or_else(|| Error::SizeOverflow {
                shape: vec![self.layers as u64, 2, self.kv_heads as u64, self.page_tokens as u64],
                dtype: "kv page",
            })
    }

    /// How many whole pages fit in `bytes`.
    pub fn pages_in(&self, bytes: usize) -> Result<usize> {
        Ok(bytes / self.bytes_per_page()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_follow_the_documented_order() {
        let l = KvLayout::new(2, 3, 8, 4, KvFormat::Bf16).unwrap();
        assert_eq!(l.page_elements(), 3 * 4 * 8);
        assert_eq!(l.element_offset(0, 0, 0, 1), 1);
        assert_eq!(l.element_offset(0, 0, 1, 0), 8);
        assert_eq!(l.element_offset(0, 1, 0, 0), 32);
        assert_eq!(l.element_offset(2, 1, 3, 7), 2 * 96 + 32 + 24 + 7);
        assert_eq!(l.bytes_per_page().unwrap(), 96 * 2 * 2 * 2);
        assert_eq!(l.pages_in(96 * 8 * 10 + 5).unwrap(), 10);
    }

    #[test]
    fn fp8_pages_take_a_byte_an_element_and_a_scale_a_row() {
        let bf16 = KvLayout::new(32, 8, 128, 64, KvFormat::Bf16).unwrap();
        let fp8 = KvLayout::new(32, 8, 128, 64, KvFormat::Fp8E4m3).unwrap();
        // Llama-3-8B's page of 64 positions: 4 MiB in bf16, 2 MiB + 128 KiB of scales in FP8.
        assert_eq!(bf16.bytes_per_page().unwrap(), 8 * 64 * 128 * 2 * 2 * 32);
        assert_eq!(fp8.bytes_per_page().unwrap(), (8 * 64 * 128 + 8 * 64 * 4) * 2 * 32);
        assert_eq!(fp8.row_offset(3, 2, 5), (3 * 8 + 2) * 64 + 5);
        assert_eq!(fp8.element_offset(3, 2, 5, 7), fp8.row_offset(3, 2, 5) * 128 + 7);
        // Nearly twice the pages in the same memory.
        let bytes = 1usize << 34;
        assert!(fp8.pages_in(bytes).unwrap() * 100 >= bf16.pages_in(bytes).unwrap() * 190);
    }

    #[test]
    fn bad_layouts_are_named() {
        assert!(matches!(
            KvLayout::new(1, 1, 64, 12, KvFormat::Bf16),
            Err(Error::InvalidArgument { name: "page_tokens", .. })
        ));
        assert!(matches!(
            KvLayout::new(1, 0, 64, 16, KvFormat::Bf16),
            Err(Error::InvalidArgument { name: "kv_heads", .. })
        ));
        assert!(matches!(
            KvLayout::new(usize::MAX / 4, 8, 128, 16, KvFormat::Bf16),
            Err(Error::SizeOverflow { .. })
        ));
    }
}
