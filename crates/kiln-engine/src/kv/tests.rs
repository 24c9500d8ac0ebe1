//! The cache against a model of it: each sequence's logical token list. Storage is simulated as
//! one value per slot, written as the hash of the sequence's tokens up to that position (what K
//! and V depend on), so a page shared or copied wrongly reads back a wrong value.

use std::hash::{DefaultHasher, Hash, Hasher};

use kiln_core::Error;
use proptest::prelude::*;

use super::*;

fn content(prefix: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    prefix.hash(&mut h);
    h.finish()
}

struct Storage {
    page_tokens: usize,
    slots: Vec<Option<u64>>,
}

impl Storage {
    fn new(pool: &PagePool) -> Storage {
        let p = pool.layout().page_tokens;
        Storage { page_tokens: p, slots: vec![None; pool.stats().pages * p] }
    }

    fn apply(&mut self, plan: &AppendPlan, tokens: &[u32]) {
        let p = self.page_tokens;
        for copy in &plan.copies {
            let (from, to) = (copy.from as usize * p, copy.to as usize * p);
            for slot in 0..copy.tokens {
                self.slots[to + slot] = self.slots[from + slot];
            }
        }
        for (k, &slot) in plan.slots.iter().enumerate() {
            self.slots[slot as usize] = Some(content(&tokens[..plan.first_position + k + 1]));
        }
    }

    fn check(&self, table: &PageTable, tokens: &[u32]) -> Result<(), String> {
        if table.tokens() != tokens {
            return Err(format!("table tokens {:?}, model {:?}", table.tokens(), tokens));
        }
        let p = self.page_tokens;
        for i in 0..tokens.len() {
            let slot = table.pages()[i / p] as usize * p + i % p;
            if self.slots[slot] != Some(content(&tokens[..=i])) {
                return Err(format!("position {i} of {tokens:?} (slot {slot}) holds the wrong K/V"));
            }
        }
        Ok(())
    }
}

struct Live {
    session: Session,
    /// The model: the tokens the sequence holds, and how many are committed.
    tokens: Vec<u32>,
    committed: usize,
}

#[derive(Debug, Clone)]
enum Op {
    Start(Vec<u32>),
    Append(usize, Vec<u32>),
    Commit(usize),
    Rollback(usize),
    Fork(usize),
    Release(usize),
}

fn tokens(max: usize) -> impl Strategy<Value = Vec<u32>> {
    // A small alphabet, so prompts share prefixes often.
    prop::collection::vec(0u32..3, 1..max)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => tokens(24).prop_map(Op::Start),
        4 => (any::<usize>(), tokens(9)).prop_map(|(i, t)| Op::Append(i, t)),
        3 => any::<usize>().prop_map(Op::Commit),
        2 => any::<usize>().prop_map(Op::Rollback),
        1 => any::<usize>().prop_map(Op::Fork),
        2 => any::<usize>().prop_map(Op::Release),
    ]
}

fn append_checked(
    pool: &mut PagePool,
    storage: &mut Storage,
    live: &mut Live,
    new: &[u32],
) -> Result<bool, String> {
    let before = pool.available_pages();
    match live.session.append(pool, new) {
        Ok(plan) => {
            live.tokens.extend_from_slice(new);
            storage.apply(&plan, &live.tokens);
            Ok(true)
        }
        Err(Error::PagePoolExhausted { requested_pages, free_pages }) => {
            if free_pages != before as u64 || requested_pages <= free_pages {
                return Err(format!("exhausted with {requested_pages} asked, {free_pages} free of {before}"));
            }
            Ok(false)
        }
        Err(e) => Err(format!("append: {e}")),
    }
}

fn run(page_tokens: usize, pages: usize, ops: Vec<Op>) -> Result<(), String> {
    let layout = KvLayout::new(1, 1, 8, page_tokens, KvFormat::Bf16).map_err(|e| e.to_string())?;
    let mut pool = PagePool::new(layout, pages).map_err(|e| e.to_string())?;
    let mut storage = Storage::new(&pool);
    let mut live: Vec<Live> = Vec::new();
    for op in ops {
        let pick = |i: usize, live: &Vec<Live>| (!live.is_empty()).then(|| i % live.len());
        match op {
            Op::Start(prompt) => {
                let (session, cached) = Session::start(&mut pool, &prompt).map_err(|e| e.to_string())?;
                if cached % page_tokens != 0 || cached >= prompt.len() {
                    return Err(format!("{cached} cached positions of a {}-token prompt", prompt.len()));
                }
                let mut entry = Live { session, tokens: prompt[..cached].to_vec(), committed: cached };
                storage.check(entry.session.table(), &entry.tokens)?;
                if append_checked(&mut pool, &mut storage, &mut entry, &prompt[cached..])? {
                    live.push(entry);
                } else {
                    entry.session.release(&mut pool);
                }
            }
            Op::Append(i, new) => {
                if let Some(i) = pick(i, &live) {
                    append_checked(&mut pool, &mut storage, &mut live[i], &new)?;
                }
            }
            Op::Commit(i) => {
                if let Some(i) = pick(i, &live) {
                    live[i].session.commit(&mut pool);
                    live[i].committed = live[i].tokens.len();
                }
            }
            Op::Rollback(i) => {
                if let Some(i) = pick(i, &live) {
                    live[i].session.rollback(&mut pool);
                    let committed = live[i].committed;
                    live[i].tokens.truncate(committed);
                }
            }
            Op::Fork(i) => {
                if let Some(i) = pick(i, &live) {
                    let session = live[i].session.fork(&mut pool);
                    live.push(Live { session, tokens: live[i].tokens.clone(), committed: live[i].committed });
                }
            }
            Op::Release(i) => {
                if let Some(i) = pick(i, &live) {
                    live.swap_remove(i).session.release(&mut pool);
                }
            }
        }
        let tables: Vec<&PageTable> = live.iter().map(|l| l.session.table()).collect();
        pool.check(&tables)?;
        for l in &live {
            storage.check(l.session.table(), &l.tokens)?;
            if l.session.committed_tokens() != l.committed {
                return Err("committed positions differ from the model".into());
            }
        }
    }
    for l in live {
        l.session.release(&mut pool);
    }
    pool.check(&[])?;
    let stats = pool.stats();
    if stats.referenced != 0 || stats.free + stats.cached != pages {
        return Err(format!("pages leaked: {stats:?}"));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn sharing_copy_on_write_eviction_and_rollback_keep_every_sequence_intact(
        page_shift in 0usize..4,
        pages in 1usize..24,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let result = run(1 << page_shift, pages, ops);
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}

fn pool(page_tokens: usize, pages: usize) -> PagePool {
    PagePool::new(KvLayout::new(1, 1, 8, page_tokens, KvFormat::Bf16).unwrap(), pages).unwrap()
}

#[test]
fn a_committed_prefix_is_found_again_and_shared() {
    let mut pool = pool(4, 8);
    let prompt: Vec<u32> = (0..10).collect();
    let (mut a, cached) = Session::start(&mut pool, &prompt).unwrap();
    assert_eq!(cached, 0);
    a.append(&mut pool, &prompt).unwrap();
    // Not committed yet: nothing to find.
    let (b, cached) = Session::start(&mut pool, &prompt).unwrap();
    assert_eq!(cached, 0);
    b.release(&mut pool);
    a.commit(&mut pool);
    let (b, cached) = Session::start(&mut pool, &prompt).unwrap();
    assert_eq!(cached, 8);
    assert_eq!(&b.table().pages()[..2], &a.table().pages()[..2]);
    assert_eq!(pool.references(a.table().pages()[0]), 2);
    // The last token is always left to compute: a prompt of exactly two pages shares one.
    let (c, cached) = Session::start(&mut pool, &prompt[..8]).unwrap();
    assert_eq!(cached, 4);
    // A different token in the first page shares nothing.
    let mut other = prompt.clone();
    other[1] = 99;
    let (d, cached) = Session::start(&mut pool, &other).unwrap();
    assert_eq!(cached, 0);
    for s in [a, b, c, d] {
        s.release(&mut pool);
    }
    assert_eq!(pool.stats().cached, 2);
    assert_eq!(pool.stats().prefix_hits, 3);
}

#[test]
fn writing_into_a_shared_page_copies_it_first() {
    let mut pool = pool(4, 8);
    let (mut a, _) = Session::start(&mut pool, &[1, 2, 3, 4, 5, 6]).unwrap();
    a.append(&mut pool, &[1, 2, 3, 4, 5, 6]).unwrap();
    let mut b = a.fork(&mut pool);
    let shared_last = a.table().pages()[1];
    let plan = b.append(&mut pool, &[7]).unwrap();
    assert_eq!(plan.copies.len(), 1);
    assert_eq!(plan.copies[0].from, shared_last);
    assert_eq!(plan.copies[0].tokens, 2);
    assert_eq!(plan.slots, vec![plan.copies[0].to * 4 + 2]);
    assert_ne!(b.table().pages()[1], shared_last);
    assert_eq!(b.table().pages()[0], a.table().pages()[0]);
    // `a` now holds its last page alone and writes in place.
    let plan = a.append(&mut pool, &[8]).unwrap();
    assert!(plan.copies.is_empty());
    assert_eq!(plan.slots, vec![shared_last * 4 + 2]);
    a.release(&mut pool);
    b.release(&mut pool);
}

#[test]
fn an_exhausted_pool_names_the_pages_and_changes_nothing() {
    let mut pool = pool(4, 3);
    let (mut a, _) = Session::start(&mut pool, &[1]).unwrap();
    a.append(&mut pool, &[1, 2, 3, 4, 5]).unwrap();
    let err = a.append(&mut pool, &[0; 9]).unwrap_err();
    assert!(matches!(err, Error::PagePoolExhausted { requested_pages: 2, free_pages: 1 }), "{err}");
    assert_eq!(err.to_string(), "KV page pool exhausted: 2 pages asked for, 1 free");
    assert_eq!(a.table().len(), 5);
    pool.check(&[a.table()]).unwrap();
    a.release(&mut pool);
}

#[test]
fn rollback_forgets_the_failed_request_and_copies_an_indexed_page_before_rewriting() {
    let mut pool = pool(4, 8);
    let (mut s, _) = Session::start(&mut pool, &[1, 2]).unwrap();
    s.append(&mut pool, &[1, 2, 3, 4, 5, 6]).unwrap();
    s.commit(&mut pool);
    s.append(&mut pool, &[7, 8, 9, 10]).unwrap();
    assert_eq!(s.table().pages().len(), 3);
    s.rollback(&mut pool);
    assert_eq!(s.table().tokens(), &[1, 2, 3, 4, 5, 6]);
    assert_eq!(s.table().pages().len(), 2);
    pool.check(&[s.table()]).unwrap();
    s.release(&mut pool);

    // A committed full page cut by a truncation is indexed: the next write copies it.
    let mut t = pool.new_table();
    pool.append(&mut t, &[9, 9, 9, 9, 9]).unwrap();
    pool.commit(&mut t);
    let indexed = t.pages()[0];
    pool.truncate(&mut t, 2);
    let plan = pool.append(&mut t, &[5]).unwrap();
    assert_eq!(plan.copies, vec![PageCopy { from: indexed, to: t.pages()[0], tokens: 2 }]);
    assert_ne!(t.pages()[0], indexed);
    pool.check(&[&t]).unwrap();
    pool.release(t);
}

#[test]
fn eviction_takes_the_least_recently_released_pages_first() {
    let mut pool = pool(2, 4);
    let (mut a, _) = Session::start(&mut pool, &[1]).unwrap();
    a.append(&mut pool, &[1, 1, 1]).unwrap();
    a.commit(&mut pool);
    let (mut b, _) = Session::start(&mut pool, &[2]).unwrap();
    b.append(&mut pool, &[2, 2, 2]).unwrap();
    b.commit(&mut pool);
    a.release(&mut pool);
    b.release(&mut pool);
    assert_eq!(pool.stats().cached, 2);
    // Two free pages, then one eviction: `a`'s page, released first.
    let (mut c, _) = Session::start(&mut pool, &[3]).unwrap();
    c.append(&mut pool, &[3, 3, 3, 3, 3]).unwrap();
    assert_eq!(pool.stats().evictions, 1);
    let (a2, cached) = Session::start(&mut pool, &[1, 1, 1]).unwrap();
    assert_eq!(cached, 0);
    let (b2, cached) = Session::start(&mut pool, &[2, 2, 2]).unwrap();
    assert_eq!(cached, 2);
    for s in [c, a2, b2] {
        s.release(&mut pool);
    }
}
