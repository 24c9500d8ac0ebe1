//! The paged KV cache: a [`PagePool`] of fixed-size pages ([`KvLayout`] documents every index and
//! unit), a [`PageTable`] per sequence, reference counts, prefixes shared copy-on-write, least
//! recently used eviction of cached prefix pages, and [`Session`]s that keep a conversation's pages
//! between requests and roll back a failed one.
//!
//! The pool does the bookkeeping; the K and V bytes live in buffers laid out as [`KvLayout`] says
//! (on the device for the CUDA backend). Each [`AppendPlan`] tells the storage what to do: page
//! copies first, then the new tokens' K and V at their slot indices.
//!
//! ```
//! use kiln_engine::kv::{KvFormat, KvLayout, PagePool, Session};
//!
//! let layout = KvLayout::new(2, 2, 64, 4, KvFormat::Bf16)?;
//! let mut pool = PagePool::new(layout, 16)?;
//! let prompt = [1, 2, 3, 4, 5, 6];
//! let (mut first, cached) = Session::start(&mut pool, &prompt)?;
//! assert_eq!(cached, 0);
//! let plan = first.append(&mut pool, &prompt)?;
//! assert_eq!(plan.slots.len(), 6);
//! // ... the model writes K and V at plan.slots ...
//! first.commit(&mut pool);
//! // A second conversation with the same opening finds the full page again.
//! let (second, cached) = Session::start(&mut pool, &prompt)?;
//! assert_eq!(cached, 4);
//! assert_eq!(second.table().pages()[0], first.table().pages()[0]);
//! # first.release(&mut pool); second.release(&mut pool);
//! # Ok::<(), kiln_core::Error>(())
//! ```

mod layout;
mod pool;
mod session;

pub use layout::{KvFormat, KvLayout};
pub use pool::{AppendPlan, PageCopy, PageId, PagePool, PageTable, PoolStats};
pub use session::Session;

#[cfg(test)]
mod tests;
