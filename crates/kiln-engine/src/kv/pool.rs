//! The page pool: which page holds what, who refers to it, and which full pages can be found
//! again by their tokens.
//!
//! Units: a page holds `page_tokens` positions (see [`KvLayout`]); a [`PageId`] indexes the pool's
//! pages in `[0, pages)` and the same page in every layer; a slot index is `page * page_tokens +
//! slot`.
//!
//! States of a page:
//! - *free*: no reference and no prefix key; handed out first;
//! - *referenced*: `references` page tables hold it (a table holds a page at most once);
//! - *cached*: no reference, but a full page still findable by its prefix key; evicted least
//!   recently released first when the free pages run out.
//!
//! Prefix sharing: the key of the i-th full page of a sequence is the hash chained over its
//! tokens and the key of page i - 1, so a page is found again only after the same tokens from
//! position 0. A lookup also compares the page's tokens and its parent's key, so a hit needs a
//! 64-bit collision of the parent chain to be wrong. A page enters the index when the table that
//! filled it commits ([`PagePool::commit`]).
//!
//! Writing: a table writes only into a page it alone holds that is not in the prefix index; any
//! other page is copied first (copy-on-write), and the copy is in the [`AppendPlan`].

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

use kiln_core::{Error, Result};

use super::layout::KvLayout;

/// A page's index in the pool, in `[0, pages)`.
pub type PageId = u32;

/// The tokens of one sequence whose K and V are in the cache, and the pages that hold them.
///
/// Position `p` lives in page `pages[p / page_tokens]` at slot `p % page_tokens`. A table is
/// created empty by [`PagePool::new_table`] and must be given back with [`PagePool::release`]
/// (its pages stay referenced otherwise).
#[derive(Debug, Default)]
pub struct PageTable {
    pages: Vec<PageId>,
    tokens: Vec<u32>,
    /// Prefix keys of the leading full pages, `keys[i]` for `pages[i]`.
    keys: Vec<u64>,
}

impl PageTable {
    /// The pages, in position order.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// The tokens whose K and V the pages hold (or are about to, after an append).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// A page to copy before the new tokens are written: every layer's `K` and `V` of page `from`
/// into page `to` (the positions of `from` the table keeps are its first `tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    pub from: PageId,
    pub to: PageId,
    pub tokens: usize,
}

/// What an append asks of the cache's storage: first the copies, then each new token's K and V
/// written at its slot index (`page * page_tokens + slot`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AppendPlan {
    /// Position of the first appended token.
    pub first_position: usize,
    pub copies: Vec<PageCopy>,
    /// One slot index per appended token, in order.
    pub slots: Vec<u32>,
}

#[derive(Debug, Clone)]
struct PrefixKey {
    key: u64,
    parent: u64,
    tokens: Box<[u32]>,
}

#[derive(Debug, Clone, Default)]
struct Page {
    references: u32,
    prefix: Option<PrefixKey>,
    /// When it became cached (its key in `cached`).
    released_at: u64,
}

/// Counts of a pool's pages by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub pages: usize,
    pub free: usize,
    pub cached: usize,
    pub referenced: usize,
    /// Cached pages evicted since the pool was made.
    pub evictions: u64,
    /// Pages found again by their prefix key.
    pub prefix_hits: u64,
}

/// The pool of KV pages (bookkeeping only; the bytes live where [`KvLayout`] says, on the host or
/// the device).
#[derive(Debug)]
pub struct PagePool {
    layout: KvLayout,
    pages: Vec<Page>,
    /// Free pages, taken from the end.
    free: Vec<PageId>,
    /// Cached pages by release time, oldest first.
    cached: BTreeMap<u64, PageId>,
    index: HashMap<u64, PageId>,
    clock: u64,
    evictions: u64,
    prefix_hits: u64,
}

/// The key of a full page: its tokens chained onto its parent's key.
fn chain_key(parent: u64, tokens: &[u32]) -> u64 {
    // SipHash with fixed keys: the same key in every process, so a key could be stored.
    let mut hasher = DefaultHasher::new();
    parent.hash(&mut hasher);
    tokens.hash(&mut hasher);
    hasher.finish()
}

/// The parent key of a sequence's first page.
const ROOT_KEY: u64 = 0x6b69_6c6e_6b76_0001;

impl PagePool {
    /// A pool of `pages` pages of `layout`.
    pub fn new(layout: KvLayout, pages: usize) -> Result<PagePool> {
        let slots = pages.checked_mul(layout.page_tokens).filter(|&s| s <= u32::MAX as usize + 1);
        if slots.is_none() {
            return Err(Error::InvalidArgument {
                name: "pages",
                value: pages.to_string(),
                reason: format!("slot indices of {} tokens per page must fit in 32 bits", layout.page_tokens),
            });
        }
        Ok(PagePool {
            layout,
            pages: vec![Page::default(); pages],
            free: (0..pages as u32).rev().collect(),
            cached: BTreeMap::new(),
            index: HashMap::new(),
            clock: 0,
            evictions: 0,
            prefix_hits: 0,
        })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Pages an allocation can take now: free ones and cached ones (evicted on demand).
    pub fn available_pages(&self) -> usize {
        self.free.len() + self.cached.len()
    }

    pub fn stats(&self) -> PoolStats {
        let referenced = self.pages.iter().filter(|p| p.references > 0).count();
        PoolStats {
            pages: self.pages.len(),
            free: self.free.len(),
            cached: self.cached.len(),
            referenced,
            evictions: self.evictions,
            prefix_hits: self.prefix_hits,
        }
    }

    /// References held on `page` (0 for a free or cached page).
    pub fn references(&self, page: PageId) -> u32 {
        self.pages.get(page as usize).map_or(0, |p| p.references)
    }

    /// A new, empty page table.
    pub fn new_table(&self) -> PageTable {
        PageTable::default()
    }

    /// Shares the cached full pages that begin `prompt` into the empty `table`, and returns how
    /// many positions they hold. At least the last token of `prompt` is left out, so the caller
    /// always computes one position (and so gets logits).
    pub fn share_prefix(&mut self, table: &mut PageTable, prompt: &[u32]) -> Result<usize> {
        if !table.is_empty() {
            return Err(Error::InvalidArgument {
                name: "table",
                value: format!("{} positions", table.len()),
                reason: "a prefix is shared into an empty page table".into(),
            });
        }
        let p = self.layout.page_tokens;
        let mut parent = ROOT_KEY;
        for chunk in prompt[..prompt.len().saturating_sub(1)].chunks_exact(p) {
            let key = chain_key(parent, chunk);
            let Some(&page) = self.index.get(&key) else { break };
            let entry = &self.pages[page as usize];
            let same = entry.prefix.as_ref().is_some_and(|k| k.parent == parent && *k.tokens == *chunk);
            if !same {
                break;
            }
            if entry.references == 0 {
                self.cached.remove(&entry.released_at);
            }
            self.pages[page as usize].references += 1;
            self.prefix_hits += 1;
            table.pages.push(page);
            table.tokens.extend_from_slice(chunk);
            table.keys.push(key);
            parent = key;
        }
        Ok(table.len())
    }

    /// Makes room for `tokens` after the table's positions and records them: new pages as needed,
    /// and a copy of the last page when the table may not write into it. All or nothing: when
    /// the pool has too few pages, the table and the pool are unchanged and the error says how
    /// many pages were asked for and how many are available.
    pub fn append(&mut self, table: &mut PageTable, tokens: &[u32]) -> Result<AppendPlan> {
        let p = self.layout.page_tokens;
        let first_position = table.len();
        let end = first_position + tokens.len();
        let partial_last = !first_position.is_multiple_of(p) && !tokens.is_empty();
        let copy_last = partial_last && !self.writable(table.pages[first_position / p]);
        let new_pages = end.div_ceil(p) - table.pages.len() + usize::from(copy_last);
        if new_pages > self.available_pages() {
            return Err(Error::PagePoolExhausted {
                requested_pages: new_pages as u64,
                free_pages: self.available_pages() as u64,
            });
        }
        let mut plan =
            AppendPlan { first_position, copies: Vec::new(), slots: Vec::with_capacity(tokens.len()) };
        if copy_last {
            let index = first_position / p;
            let from = table.pages[index];
            let to = self.take_page()?;
            plan.copies.push(PageCopy { from, to, tokens: first_position % p });
            self.drop_reference(from);
            table.pages[index] = to;
        }
        while table.pages.len() < end.div_ceil(p) {
            let page = self.take_page()?;
            table.pages.push(page);
        }
        for position in first_position..end {
            plan.slots.push(table.pages[position / p] * p as u32 + (position % p) as u32);
        }
        table.tokens.extend_from_slice(tokens);
        Ok(plan)
    }

    /// Enters the table's full pages into the prefix index, once their K and V are written.
    pub fn commit(&mut self, table: &mut PageTable) {
        let p = self.layout.page_tokens;
        while table.keys.len() < table.len() / p {
            let i = table.keys.len();
            let parent = table.keys.last().copied().unwrap_or(ROOT_KEY);
            let chunk = &table.tokens[i * p..(i + 1) * p];
            let key = chain_key(parent, chunk);
            table.keys.push(key);
            let page = table.pages[i];
            if self.pages[page as usize].prefix.is_some() || self.index.contains_key(&key) {
                // Already findable (shared from the index), or another page holds the same prefix.
                continue;
            }
            self.index.insert(key, page);
            self.pages[page as usize].prefix = Some(PrefixKey { key, parent, tokens: chunk.into() });
        }
    }

    /// Forgets the positions from `len` on: pages past it are released; a page cut in the middle
    /// stays, and a later append copies it if it is shared or indexed.
    pub fn truncate(&mut self, table: &mut PageTable, len: usize) {
        if len >= table.len() {
            return;
        }
        let p = self.layout.page_tokens;
        table.tokens.truncate(len);
        table.keys.truncate(len / p);
        while table.pages.len() > len.div_ceil(p) {
            if let Some(page) = table.pages.pop() {
                self.drop_reference(page);
            }
        }
    }

    /// A second table holding the same positions in the same pages (parallel samples, beams).
    pub fn fork(&mut self, table: &PageTable) -> PageTable {
        for &page in &table.pages {
            self.pages[page as usize].references += 1;
        }
        PageTable { pages: table.pages.clone(), tokens: table.tokens.clone(), keys: table.keys.clone() }
    }

    /// Gives back every page of `table`; the last pages become the first to evict.
    pub fn release(&mut self, mut table: PageTable) {
        self.truncate(&mut table, 0);
    }

    fn writable(&self, page: PageId) -> bool {
        let entry = &self.pages[page as usize];
        entry.references == 1 && entry.prefix.is_none()
    }

    /// A page with one reference: a free one, else the least recently cached one.
    fn take_page(&mut self) -> Result<PageId> {
        let page = match self.free.pop() {
            Some(page) => page,
            None => {
                let (_, page) = self
                    .cached
                    .pop_first()
                    .ok_or(Error::PagePoolExhausted { requested_pages: 1, free_pages: 0 })?;
                if let Some(prefix) = self.pages[page as usize].prefix.take() {
                    if self.index.get(&prefix.key) == Some(&page) {
                        self.index.remove(&prefix.key);
                    }
                }
                self.evictions += 1;
                page
            }
        };
        self.pages[page as usize].references = 1;
        Ok(page)
    }

    fn drop_reference(&mut self, page: PageId) {
        let entry = &mut self.pages[page as usize];
        entry.references = entry.references.saturating_sub(1);
        if entry.references == 0 {
            if entry.prefix.is_some() {
                self.clock += 1;
                entry.released_at = self.clock;
                self.cached.insert(self.clock, page);
            } else {
                self.free.push(page);
            }
        }
    }

    /// Checks the pool's books against the tables that hold its pages; the first broken rule.
    pub fn check(&self, tables: &[&PageTable]) -> std::result::Result<(), String> {
        let p = self.layout.page_tokens;
        let mut references = vec![0u32; self.pages.len()];
        for table in tables {
            if table.pages.len() != table.len().div_ceil(p) || table.keys.len() > table.len() / p {
                return Err(format!("table of {} positions has {} pages", table.len(), table.pages.len()));
            }
            for &page in &table.pages {
                references[page as usize] += 1;
            }
        }
        let mut states = vec![0u8; self.pages.len()];
        for &page in &self.free {
            states[page as usize] += 1;
        }
        for &page in self.cached.values() {
            states[page as usize] += 1;
        }
        for (i, page) in self.pages.iter().enumerate() {
            if page.references != references[i] {
                return Err(format!(
                    "page {i}: {} references counted, {} held",
                    page.references, references[i]
                ));
            }
            let unreferenced = page.references == 0;
            if states[i] != u8::from(unreferenced) {
                return Err(format!("page {i}: on {} lists with {} references", states[i], page.references));
            }
            if unreferenced && page.prefix.is_some() != self.cached.values().any(|&c| c as usize == i) {
                return Err(format!("page {i}: keyed but not cached, or cached without a key"));
            }
            if let Some(prefix) = &page.prefix {
                if self.index.get(&prefix.key) != Some(&(i as u32)) {
                    return Err(format!("page {i}: keyed but not in the index"));
                }
            }
        }
        for (&key, &page) in &self.index {
            if self.pages[page as usize].prefix.as_ref().map(|k| k.key) != Some(key) {
                return Err(format!("index entry {key:#x} names page {page}, which has another key"));
            }
        }
        Ok(())
    }
}
