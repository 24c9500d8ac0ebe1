//! Sessions: a conversation's pages kept between requests.
//!
//! A request appends its tokens (the new prompt, then each generated token) after the
//! conversation's committed positions. When it ends well, [`Session::commit`] makes those
//! positions part of the conversation and enters its full pages into the prefix index; when it
//! fails, [`Session::rollback`] forgets every position past the last committed one, so the next
//! request starts from a cache that holds exactly the conversation.

use kiln_core::Result;

use super::pool::{AppendPlan, PagePool, PageTable};

/// One conversation's page table and how much of it is committed.
#[derive(Debug, Default)]
pub struct Session {
    table: PageTable,
    committed_tokens: usize,
}

impl Session {
    /// A new session whose first prompt is `prompt`: the cached pages that begin it are shared,
    /// committed, and their positions returned; the caller appends `prompt[cached..]`.
    pub fn start(pool: &mut PagePool, prompt: &[u32]) -> Result<(Session, usize)> {
        let mut table = pool.new_table();
        let cached = pool.share_prefix(&mut table, prompt)?;
        Ok((Session { table, committed_tokens: cached }, cached))
    }

    pub fn table(&self) -> &PageTable {
        &self.table
    }

    /// Positions that survive a failed request.
    pub fn committed_tokens(&self) -> usize {
        self.committed_tokens
    }

    /// Appends tokens of the current request (see [`PagePool::append`]).
    pub fn append(&mut self, pool: &mut PagePool, tokens: &[u32]) -> Result<AppendPlan> {
        pool.append(&mut self.table, tokens)
    }

    /// A second session holding the same positions in the same pages (parallel samples from one
    /// conversation); its writes copy the shared pages first.
    pub fn fork(&self, pool: &mut PagePool) -> Session {
        Session { table: pool.fork(&self.table), committed_tokens: self.committed_tokens }
    }

    /// The request succeeded: its positions are the conversation's.
    pub fn commit(&mut self, pool: &mut PagePool) {
        self.committed_tokens = self.table.len();
        pool.commit(&mut self.table);
    }

    /// The request failed: forgets the positions past the last committed one.
    pub fn rollback(&mut self, pool: &mut PagePool) {
        pool.truncate(&mut self.table, self.committed_tokens);
    }

    /// Ends the conversation; its committed full pages stay findable until evicted.
    pub fn release(self, pool: &mut PagePool) {
        pool.release(self.table);
    }
}
