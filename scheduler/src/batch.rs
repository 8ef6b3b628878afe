//! Running batch jobs as the planner sees them: which may be halted for a session, which are
//! halting already, and which a session waits for; and the search for the fewest jobs to halt
//! so that a session can start.
//!
//! A job is *eligible* for halting when it runs (not MUSTHALT or HALTING) and is past its
//! min duration. A job that is halting already (asked before this plan, or by this plan for its
//! max duration) and that no session waits for yet is *claimable*: a session may wait for it
//! without halting anything more. Once a session halts or waits for a job, the job is
//! *claimed* and no other session counts on its GPUs.
//!
//! [`Batch::preempt`] looks, node by node (only the session's pinned node when it has one), at
//! the GPUs that fit the session: those with a free place it takes all (there are fewer than
//! it needs, or it would have been placed), then GPUs held by claimable jobs (least capable
//! first), then GPUs freed by halting eligible jobs. Jobs are chosen one at a time: while no
//! single job frees what is still missing, the one freeing the most (then the one with fewer
//! GPUs in all, then the lower id); then, among those that suffice, the one with the fewest
//! GPUs in all (then the one freeing the least capable GPU, then the lower id).
//! This is the fewest jobs whenever no GPU the session could use is shared by two eligible
//! jobs (always on exclusive GPUs). Among nodes the winner has the fewest jobs to halt, then
//! the fewest GPUs halted in all, then the least capable GPUs for the session (compared from
//! the most capable down), then the node name.
//!
//! A one-GPU session that is not pinned (most of them) does not look at every node: it has no
//! free GPU anywhere, so the rule above reduces to "the least (class, node, GPU) held by a
//! claimable job, else the least (GPUs of the job, class, node, GPU, job) held by an eligible
//! job", which per-class ordered sets of such *options* answer at once. The sets are kept in
//! step with every place taken and every job claimed. Other sessions look node by node, but a
//! node whose counts (per class, GPUs with a free place, held by halting jobs, held by eligible
//! jobs; kept in step the same way) show that it cannot beat the best node so far is skipped
//! without a look at its GPUs.

use std::cmp::Ordering;
use std::collections::{BTreeSet, HashMap};

use chrono::{DateTime, Utc};
use ongrid_core::{HumanDuration, JobId};

use crate::index::Index;
use crate::site::{HaltWait, SiteState};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Running,
    /// Halting, and no session waits for it.
    Halting,
    /// A session halted it or waits for it.
    Claimed,
}

/// Which running jobs a request may halt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Halting<'a> {
    /// A session's: jobs past their min duration.
    Interactive,
    /// Owner work's, on its group's GPUs: any job of another group (backfill).
    Backfill { group: &'a str },
}

#[derive(Debug)]
struct Job {
    id: JobId,
    /// Its owner's accounting group, from the site's policy.
    group: Option<String>,
    /// Its GPUs that are in the index.
    gpus: Vec<usize>,
    /// All its GPUs.
    total: usize,
    past_min_duration: bool,
    status: Status,
}

impl Job {
    fn eligible(&self) -> bool {
        self.status == Status::Running && self.past_min_duration
    }

    fn may_halt(&self, halting: Halting<'_>) -> bool {
        match halting {
            Halting::Interactive => self.eligible(),
            Halting::Backfill { group } => {
                self.status == Status::Running && self.group.as_deref() != Some(group)
            }
        }
    }
}

/// What halting on one node would give a session.
#[derive(Debug)]
pub(crate) struct Preemption {
    pub node: usize,
    /// The session's GPUs, least capable first.
    pub gpus: Vec<usize>,
    /// Jobs to halt now, by id.
    pub halt: Vec<JobId>,
    /// Every job the session waits for (`halt` and claimable jobs), by id.
    pub wait_for: Vec<JobId>,
    halt_numbers: Vec<usize>,
    claim_numbers: Vec<usize>,
    key: Key,
}

/// How preemptions compare, least first: jobs halted, GPUs halted in all, the session's classes
/// from the most capable down, node.
type Key = (usize, usize, Vec<usize>, usize);

/// What a session that halts jobs ([`Halting::Interactive`]) could do with a GPU, as
/// [`Batch::preempt`] sees it: take a free place, wait for a job halting already, or halt an
/// eligible job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tier {
    Free = 0,
    Wait = 1,
    Halt = 2,
}

#[derive(Debug)]
pub(crate) struct Batch {
    /// In id order, so a job's number orders like its id.
    jobs: Vec<Job>,
    by_id: HashMap<JobId, usize>,
    /// The jobs holding each GPU, by GPU number and job number.
    holders: Vec<Vec<usize>>,
    /// The jobs on each node, by node number and job number.
    on_node: Vec<Vec<usize>>,
    /// The nodes with jobs, in number order.
    nodes_with_jobs: Vec<usize>,
    /// Per node: the most of its GPUs one job holds.
    widest_job: Vec<usize>,
    /// Per class: full GPUs with a claimable holder, as `(node, GPU)`.
    wait_options: Vec<BTreeSet<(usize, usize)>>,
    /// Per class: `(job's GPUs, node, GPU, job)` for each full GPU and eligible job holding it.
    halt_options: Vec<BTreeSet<(usize, usize, usize, usize)>>,
    /// The options each GPU is in now, by GPU number, to take them out when it changes.
    options_of: Vec<Vec<Option_>>,
    /// Per node with jobs, per class: GPUs a session could get there, by [`Tier`] (empty for
    /// other nodes). Bounds that skip most nodes without a look.
    obtainable: Vec<Vec<[u32; 3]>>,
    /// The tier a GPU counts in `obtainable` under now, by GPU number.
    counted: Vec<Option<Tier>>,
}

#[derive(Debug, Clone, Copy)]
enum Option_ {
    Wait(usize, (usize, usize)),
    Halt(usize, (usize, usize, usize, usize)),
}

impl Batch {
    pub fn new(site: &SiteState, index: &Index<'_>, now: DateTime<Utc>) -> Self {
        let mut running: Vec<_> = site.running_jobs.iter().collect();
        running.sort_by_key(|job| job.id);
        let mut batch = Self {
            jobs: Vec::new(),
            by_id: HashMap::new(),
            holders: vec![Vec::new(); index.gpu_count()],
            on_node: vec![Vec::new(); index.node_count()],
            nodes_with_jobs: Vec::new(),
            widest_job: vec![0; index.node_count()],
            wait_options: vec![BTreeSet::new(); index.class_count()],
            halt_options: vec![BTreeSet::new(); index.class_count()],
            options_of: vec![Vec::new(); index.gpu_count()],
            obtainable: vec![Vec::new(); index.node_count()],
            counted: vec![None; index.gpu_count()],
        };
        for job in running {
            let Some(node) = index.node_named(&job.node) else {
                continue;
            };
            let gpus: Vec<usize> = job
                .gpus
                .iter()
                .filter_map(|uuid| index.gpu_on(node, uuid))
                .collect();
            let number = batch.jobs.len();
            for &gpu in &gpus {
                batch.holders[gpu].push(number);
            }
            batch.on_node[node].push(number);
            batch.widest_job[node] = batch.widest_job[node].max(gpus.len());
            batch.by_id.insert(job.id, number);
            batch.jobs.push(Job {
                id: job.id,
                group: site
                    .policy
                    .jobs
                    .get(&job.id)
                    .and_then(|access| access.group.clone()),
                gpus,
                total: job.gpus.len(),
                past_min_duration: reached(job.started_at, job.min_duration, now),
                status: if job.halting {
                    Status::Halting
                } else {
                    Status::Running
                },
            });
        }
        batch.nodes_with_jobs = (0..index.node_count())
            .filter(|&node| !batch.on_node[node].is_empty())
            .collect();
        batch
    }

    /// Builds the one-GPU options; call once the plan's max-duration halts and the waiting
    /// sessions' claims are recorded, then [`Batch::refresh`] after every change.
    pub fn build_options(&mut self, index: &Index<'_>) {
        let mut gpus = Vec::new();
        for &node in &self.nodes_with_jobs {
            self.obtainable[node] = vec![[0; 3]; index.class_count()];
            gpus.extend(index.gpus_of(node));
        }
        self.refresh(index, &gpus);
    }

    /// Brings the options of these GPUs up to date.
    pub fn refresh(&mut self, index: &Index<'_>, gpus: &[usize]) {
        for &gpu in gpus {
            for option in std::mem::take(&mut self.options_of[gpu]) {
                match option {
                    Option_::Wait(class, entry) => self.wait_options[class].remove(&entry),
                    Option_::Halt(class, entry) => self.halt_options[class].remove(&entry),
                };
            }
            let (class, node) = (index.class_of(gpu), index.node_of(gpu));
            let holders = &self.holders[gpu];
            let halting = || {
                holders
                    .iter()
                    .any(|&j| self.jobs[j].status == Status::Halting)
            };
            let tier = if index.free(gpu) > 0 {
                Some(Tier::Free)
            } else if halting() {
                Some(Tier::Wait)
            } else if holders.iter().any(|&j| self.jobs[j].eligible()) {
                Some(Tier::Halt)
            } else {
                None
            };
            let counts = &mut self.obtainable[node];
            if !counts.is_empty() {
                let was = std::mem::replace(&mut self.counted[gpu], tier);
                if let Some(was) = was {
                    counts[class][was as usize] -= 1;
                }
                if let Some(tier) = tier {
                    counts[class][tier as usize] += 1;
                }
            }
            if index.free(gpu) > 0 || holders.is_empty() {
                continue;
            }
            let mut options = Vec::new();
            if holders
                .iter()
                .any(|&j| self.jobs[j].status == Status::Halting)
            {
                options.push(Option_::Wait(class, (node, gpu)));
            }
            for &j in holders.iter().filter(|&&j| self.jobs[j].eligible()) {
                options.push(Option_::Halt(class, (self.jobs[j].total, node, gpu, j)));
            }
            for option in &options {
                match *option {
                    Option_::Wait(class, entry) => self.wait_options[class].insert(entry),
                    Option_::Halt(class, entry) => self.halt_options[class].insert(entry),
                };
            }
            self.options_of[gpu] = options;
        }
    }

    /// [`Batch::preempt`] for a one-GPU session that is not pinned, from the options.
    fn preempt_one(&self, fits: &[bool]) -> Option<Preemption> {
        let fitting = || (0..fits.len()).filter(|&class| fits[class]);
        let wait = fitting()
            .filter_map(|class| {
                self.wait_options[class]
                    .first()
                    .map(|&(node, gpu)| (class, node, gpu))
            })
            .min();
        if let Some((class, node, gpu)) = wait {
            let job = self.holders[gpu]
                .iter()
                .copied()
                .find(|&j| self.jobs[j].status == Status::Halting)?;
            return Some(Preemption {
                node,
                gpus: vec![gpu],
                halt: Vec::new(),
                wait_for: vec![self.jobs[job].id],
                halt_numbers: Vec::new(),
                claim_numbers: vec![job],
                key: (0, 0, vec![class], node),
            });
        }
        let (total, class, node, gpu, job) = fitting()
            .filter_map(|class| {
                self.halt_options[class]
                    .first()
                    .map(|&(total, node, gpu, job)| (total, class, node, gpu, job))
            })
            .min()?;
        Some(Preemption {
            node,
            gpus: vec![gpu],
            halt: vec![self.jobs[job].id],
            wait_for: vec![self.jobs[job].id],
            halt_numbers: vec![job],
            claim_numbers: Vec::new(),
            key: (1, total, vec![class], node),
        })
    }

    /// The GPUs whose options change when this preemption is committed.
    fn touched(&self, preemption: &Preemption) -> Vec<usize> {
        let mut gpus = preemption.gpus.clone();
        for &job in preemption
            .halt_numbers
            .iter()
            .chain(&preemption.claim_numbers)
        {
            gpus.extend_from_slice(&self.jobs[job].gpus);
        }
        gpus
    }

    /// Marks a job halting (halted by this plan for its max duration).
    pub fn halting(&mut self, id: JobId) {
        if let Some(&number) = self.by_id.get(&id) {
            if self.jobs[number].status == Status::Running {
                self.jobs[number].status = Status::Halting;
            }
        }
    }

    /// A session waits for these jobs (an earlier plan's [`HaltWait`]).
    pub fn claim(&mut self, wait: &HaltWait) {
        for id in &wait.jobs {
            if let Some(&number) = self.by_id.get(id) {
                self.jobs[number].status = Status::Claimed;
            }
        }
    }

    /// The best halting on the request's `pinned` node, or on any node, or `None`. A session
    /// halts jobs past their min duration; owner work ([`Halting::Backfill`], with `fits` only
    /// its group's GPUs) halts other groups' jobs there.
    pub fn preempt(
        &self,
        index: &Index<'_>,
        fits: &[bool],
        count: u32,
        pinned: Option<usize>,
        halting: Halting<'_>,
    ) -> Option<Preemption> {
        if halting != Halting::Interactive {
            let count = usize::try_from(count).ok()?;
            let nodes = match &pinned {
                Some(node) => std::slice::from_ref(node),
                None => self.nodes_with_jobs.as_slice(),
            };
            return nodes
                .iter()
                .copied()
                .filter_map(|node| self.on_node_(index, node, fits, count, halting))
                .min_by(|a, b| a.key.cmp(&b.key));
        }
        if count == 1 && pinned.is_none() {
            return self.preempt_one(fits);
        }
        let count = usize::try_from(count).ok()?;
        let mut best: Option<Preemption> = None;
        let fitting: Vec<usize> = (0..fits.len()).filter(|&class| fits[class]).collect();
        let nodes = match &pinned {
            Some(node) => std::slice::from_ref(node),
            None => self.nodes_with_jobs.as_slice(),
        };
        let mut scratch = Vec::new();
        for &node in nodes {
            let best_key = best.as_ref().map(|best| &best.key);
            if !self.may_beat(node, &fitting, count, best_key, &mut scratch) {
                continue;
            }
            let Some(candidate) = self.on_node_(index, node, fits, count, halting) else {
                continue;
            };
            if best.as_ref().is_none_or(|best| candidate.key < best.key) {
                best = Some(candidate);
            }
        }
        best
    }

    /// Whether a preemption on `node` for a session of `count` GPUs of these classes
    /// (ascending) could beat `best`, judged from the counts alone. The session takes every
    /// free GPU (it would have been placed had there been `count`), then the least GPUs of jobs
    /// halting already; what is still missing is halted, by as many jobs as it takes when each
    /// frees as many GPUs as the node's widest job holds, and at best on the least GPUs
    /// eligible jobs hold. `classes` is scratch space.
    fn may_beat(
        &self,
        node: usize,
        fitting: &[usize],
        count: usize,
        best: Option<&Key>,
        classes: &mut Vec<usize>,
    ) -> bool {
        let counts = &self.obtainable[node];
        if counts.is_empty() {
            return false;
        }
        let mut gpus = [0; 3];
        for &class in fitting {
            for (sum, n) in gpus.iter_mut().zip(counts[class]) {
                *sum += n as usize;
            }
        }
        let [free, wait, halt] = gpus;
        if free >= count || free + wait + halt < count {
            return false;
        }
        let missing = count.saturating_sub(free + wait);
        let jobs = missing.div_ceil(self.widest_job[node].max(1));
        let Some(best) = best else {
            return true;
        };
        match (jobs, missing).cmp(&(best.0, best.1)) {
            Ordering::Less => return true,
            Ordering::Greater => return false,
            Ordering::Equal => {}
        }
        // Adds the least GPUs of a tier, up to `count` in all.
        let take = |tier: Tier, classes: &mut Vec<usize>| {
            for &class in fitting {
                let gpus = counts[class][tier as usize] as usize;
                classes.extend(std::iter::repeat_n(class, gpus.min(count - classes.len())));
            }
        };
        classes.clear();
        take(Tier::Free, classes);
        take(Tier::Wait, classes);
        take(Tier::Halt, classes);
        classes.sort_unstable_by(|a, b| b.cmp(a));
        (classes.as_slice(), node) < (best.2.as_slice(), best.3)
    }

    fn on_node_(
        &self,
        index: &Index<'_>,
        node: usize,
        fits: &[bool],
        count: usize,
        halting: Halting<'_>,
    ) -> Option<Preemption> {
        let jobs = &self.on_node[node];
        if !jobs
            .iter()
            .any(|&j| self.jobs[j].may_halt(halting) || self.jobs[j].status == Status::Halting)
        {
            return None;
        }
        let mut free = Vec::new();
        let mut waiting = Vec::new();
        let mut haltable = Vec::new();
        for gpu in index.gpus_of(node) {
            if !fits[index.class_of(gpu)] {
                continue;
            }
            if index.free(gpu) > 0 {
                free.push(gpu);
                continue;
            }
            let holders = &self.holders[gpu];
            if let Some(&job) = holders
                .iter()
                .find(|&&j| self.jobs[j].status == Status::Halting)
            {
                waiting.push((gpu, job));
            } else if holders.iter().any(|&j| self.jobs[j].may_halt(halting)) {
                haltable.push(gpu);
            }
        }
        if free.len() >= count || free.len() + waiting.len() + haltable.len() < count {
            return None;
        }
        let mut need = count - free.len();
        let mut gpus = free;
        waiting.sort_by_key(|&(gpu, _)| (index.class_of(gpu), gpu));
        let mut claim_numbers: Vec<usize> = Vec::new();
        for &(gpu, job) in waiting.iter().take(need) {
            gpus.push(gpu);
            claim_numbers.push(job);
        }
        need -= waiting.len().min(need);
        let halt_numbers = if need > 0 {
            let (halted, covered) = self.halts_freeing(index, jobs, haltable, need, halting)?;
            gpus.extend_from_slice(&covered[..need]);
            halted
        } else {
            Vec::new()
        };
        Some(self.preemption(index, node, gpus, claim_numbers, halt_numbers))
    }

    /// The jobs of `jobs` to halt so that `need` of the `haltable` GPUs are freed: a job that
    /// frees enough alone (the smallest, then the one freeing the least GPU), else the one
    /// freeing most, until enough are covered. Their numbers, and the GPUs covered, least first;
    /// `None` when the jobs cannot free enough.
    fn halts_freeing(
        &self,
        index: &Index<'_>,
        jobs: &[usize],
        haltable: Vec<usize>,
        need: usize,
        halting: Halting<'_>,
    ) -> Option<(Vec<usize>, Vec<usize>)> {
        let mut uncovered = haltable;
        let mut halt_numbers: Vec<usize> = Vec::new();
        let mut covered: Vec<usize> = Vec::new();
        while covered.len() < need {
            let missing = need - covered.len();
            let freeing = |j: usize| {
                self.jobs[j]
                    .gpus
                    .iter()
                    .filter(|gpu| uncovered.contains(gpu))
                    .count()
            };
            // The least GPU a job frees, as (class, GPU).
            let least = |j: usize| {
                self.jobs[j]
                    .gpus
                    .iter()
                    .filter(|gpu| uncovered.contains(gpu))
                    .map(|&gpu| (index.class_of(gpu), gpu))
                    .min()
            };
            let options = jobs
                .iter()
                .copied()
                .filter(|&j| self.jobs[j].may_halt(halting) && !halt_numbers.contains(&j))
                .map(|j| (j, freeing(j)))
                .filter(|&(_, frees)| frees > 0);
            let sufficient = options
                .clone()
                .filter(|&(_, frees)| frees >= missing)
                .min_by_key(|&(j, _)| (self.jobs[j].total, least(j), j));
            let (job, _) = match sufficient {
                Some(choice) => choice,
                None => options
                    .min_by_key(|&(j, frees)| (std::cmp::Reverse(frees), self.jobs[j].total, j))?,
            };
            halt_numbers.push(job);
            for gpu in &self.jobs[job].gpus {
                if let Some(position) = uncovered.iter().position(|g| g == gpu) {
                    covered.push(uncovered.swap_remove(position));
                }
            }
        }
        covered.sort_by_key(|&gpu| (index.class_of(gpu), gpu));
        Some((halt_numbers, covered))
    }

    /// The preemption taking `gpus` on `node`, claiming the halting jobs `claim_numbers` and
    /// halting `halt_numbers`, with the key that ranks it among the other nodes'.
    fn preemption(
        &self,
        index: &Index<'_>,
        node: usize,
        mut gpus: Vec<usize>,
        mut claim_numbers: Vec<usize>,
        mut halt_numbers: Vec<usize>,
    ) -> Preemption {
        gpus.sort_by_key(|&gpu| (index.class_of(gpu), gpu));
        claim_numbers.sort_unstable();
        claim_numbers.dedup();
        halt_numbers.sort_unstable();
        let mut top_down: Vec<usize> = gpus.iter().map(|&gpu| index.class_of(gpu)).collect();
        top_down.sort_unstable_by(|a, b| b.cmp(a));
        let halted_gpus = halt_numbers.iter().map(|&j| self.jobs[j].total).sum();
        let mut wait_for: Vec<JobId> = halt_numbers
            .iter()
            .chain(&claim_numbers)
            .map(|&j| self.jobs[j].id)
            .collect();
        wait_for.sort_unstable();
        Preemption {
            node,
            gpus,
            halt: halt_numbers.iter().map(|&j| self.jobs[j].id).collect(),
            wait_for,
            key: (halt_numbers.len(), halted_gpus, top_down, node),
            halt_numbers,
            claim_numbers,
        }
    }

    /// Carries out a chosen preemption in the round's books: its jobs are claimed
    /// ([`Batch::commit`]), its GPUs that are free now are taken from `index`, and the options of
    /// every GPU it touched are brought up to date.
    pub fn apply(&mut self, index: &mut Index<'_>, preemption: &Preemption) {
        self.commit(preemption);
        let free: Vec<usize> = preemption
            .gpus
            .iter()
            .copied()
            .filter(|&gpu| index.free(gpu) > 0)
            .collect();
        index.take(preemption.node, &free);
        let touched = self.touched(preemption);
        self.refresh(index, &touched);
    }

    /// Records a chosen preemption: its jobs are claimed.
    fn commit(&mut self, preemption: &Preemption) {
        for &job in preemption
            .halt_numbers
            .iter()
            .chain(&preemption.claim_numbers)
        {
            self.jobs[job].status = Status::Claimed;
        }
    }
}

/// Whether `started + duration <= now` (`None` is no duration).
pub(crate) fn reached(
    started: DateTime<Utc>,
    duration: Option<HumanDuration>,
    now: DateTime<Utc>,
) -> bool {
    let Some(duration) = duration else {
        return true;
    };
    chrono::Duration::from_std(duration.as_duration())
        .ok()
        .and_then(|d| started.checked_add_signed(d))
        .is_some_and(|end| end <= now)
}

#[cfg(test)]
mod tests {
    use ongrid_core::{GpuMode, Sharing};
    use proptest::prelude::*;

    use super::*;
    use crate::policy::{Policy, Who};
    use crate::site::{NodeState, SiteState};
    use crate::testing::*;

    impl Batch {
        /// [`Batch::preempt`] for a session without skipping any node: the least key of all.
        fn preempt_everywhere(
            &self,
            index: &Index<'_>,
            fits: &[bool],
            count: usize,
            pinned: Option<usize>,
        ) -> Option<Preemption> {
            let nodes: Vec<usize> = match pinned {
                Some(node) => vec![node],
                None => (0..index.node_count()).collect(),
            };
            nodes
                .into_iter()
                .filter_map(|node| self.on_node_(index, node, fits, count, Halting::Interactive))
                .min_by(|a, b| a.key.cmp(&b.key))
        }
    }

    /// A GPU: (kind, holders). Kinds 0..4 are a T4, an A100, an H100 and a shared:2 A100.
    /// Each holder is a job: (GPUs it holds from here on, whether past its min duration,
    /// whether halting).
    type GpuSpec = (u8, Vec<(usize, bool, bool)>);

    /// Nodes of GPUs; a job holds the GPU it is listed on and the next ones on its node, each
    /// GPU holding at most its capacity.
    fn site(nodes: &[Vec<GpuSpec>]) -> SiteState {
        let mut site = SiteState::default();
        let mut uuid_number = 0;
        let mut job_number = 0;
        for (n, specs) in nodes.iter().enumerate() {
            let name = format!("n{n}");
            let mut gpus: Vec<_> = specs
                .iter()
                .map(|(kind, _)| {
                    uuid_number += 1;
                    match kind {
                        0 => t4(uuid_number),
                        1 => a100(uuid_number),
                        2 => h100(uuid_number),
                        _ => gpu(uuid_number, "8.0", "40G", "shared:2"),
                    }
                })
                .collect();
            for (first, (_, holders)) in specs.iter().enumerate() {
                for &(width, past_min, halting) in holders {
                    let held: Vec<usize> = (first..gpus.len().min(first + width))
                        .filter(|&g| gpus[g].used < gpus[g].mode.capacity())
                        .collect();
                    if held.is_empty() {
                        continue;
                    }
                    job_number += 1;
                    let numbers: Vec<u32> = held
                        .iter()
                        .map(|&g| {
                            gpus[g].used += 1;
                            uuid_number + 1 - (gpus.len() - g) as u32
                        })
                        .collect();
                    let min = if past_min { 0 } else { 3600 };
                    let mut job = running_job(job_number, &name, &numbers, 0, min);
                    job.halting = halting;
                    site.running_jobs.push(job);
                }
            }
            site.nodes.push(NodeState {
                gpus,
                ..node(&name, Vec::new())
            });
        }
        site
    }

    fn gpu_spec() -> impl Strategy<Value = GpuSpec> {
        let holder = (1usize..4, any::<bool>(), prop::bool::weighted(0.2));
        (0u8..4, prop::collection::vec(holder, 0..3))
    }

    /// A step: take a free GPU (by position among them), or preempt for a request of
    /// `count` GPUs (capability 8.0 or more, or any; exclusive, or any mode), pinned or not.
    #[derive(Debug, Clone)]
    enum Step {
        Take(usize),
        Preempt {
            count: u32,
            capable: bool,
            exclusive: bool,
            pinned: Option<usize>,
        },
    }

    fn step(nodes: usize) -> impl Strategy<Value = Step> {
        prop_oneof![
            (0usize..64).prop_map(Step::Take),
            (
                1u32..6,
                any::<bool>(),
                any::<bool>(),
                prop::option::weighted(0.2, 0..nodes)
            )
                .prop_map(|(count, capable, exclusive, pinned)| Step::Preempt {
                    count,
                    capable,
                    exclusive,
                    pinned,
                }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Skipping nodes by their counts never changes which preemption wins: it is always
        /// the least of every node's, as the state changes with places taken and jobs claimed.
        #[test]
        fn preempt_finds_the_least_preemption_of_all_nodes(
            (nodes, steps) in prop::collection::vec(prop::collection::vec(gpu_spec(), 1..9), 1..7)
                .prop_flat_map(|nodes| {
                    let count = nodes.len();
                    (Just(nodes), prop::collection::vec(step(count), 1..24))
                })
        ) {
            let site = site(&nodes);
            let now = at(100);
            let mut index = Index::new(&site, now);
            let mut batch = Batch::new(&site, &index, now);
            batch.build_options(&index);
            let policy = Policy::default();
            let who = Who::session(&policy, &session_id(1));
            for step in steps {
                match step {
                    Step::Take(position) => {
                        let free: Vec<usize> = (0..index.gpu_count())
                            .filter(|&gpu| index.free(gpu) > 0)
                            .collect();
                        if let Some(&gpu) = free.get(position % free.len().max(1)) {
                            index.take(index.node_of(gpu), &[gpu]);
                            batch.refresh(&index, &[gpu]);
                        }
                    }
                    Step::Preempt { count, capable, exclusive, pinned } => {
                        let sharing = if exclusive { Sharing::Exclusive } else { Sharing::Any };
                        let capability = capable.then_some("8.0");
                        let fits = index.fitting_classes(&request(count, capability, None, sharing), &who);
                        let pinned = pinned.filter(|&node| node < index.node_count());
                        if count == 1 && pinned.is_none() {
                            continue;
                        }
                        let fast = batch.preempt(&index, &fits, count, pinned, Halting::Interactive);
                        let everywhere = batch.preempt_everywhere(&index, &fits, count as usize, pinned);
                        let summary = |p: &Option<Preemption>| {
                            p.as_ref().map(|p| (p.key.clone(), p.gpus.clone(), p.halt.clone(), p.wait_for.clone()))
                        };
                        prop_assert_eq!(summary(&fast), summary(&everywhere));
                        if let Some(preemption) = fast {
                            batch.apply(&mut index, &preemption);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_test_sites_hold_jobs_of_several_gpus_and_shared_gpus_of_two_jobs() {
        let halting_pair = (2, true, true);
        let site = site(&[vec![(3, vec![(1, true, false), halting_pair]), (0, vec![])]]);
        assert_eq!(site.running_jobs.len(), 2);
        assert_eq!(site.running_jobs[1].gpus, [uuid(1), uuid(2)]);
        assert!(site.running_jobs[1].halting);
        assert_eq!(site.nodes[0].gpus[0].used, 2);
        assert_eq!(
            site.nodes[0].gpus[0].mode,
            GpuMode::Shared { max_sessions: 2 }
        );
        assert_eq!(site.nodes[0].gpus[1].used, 1);
    }
}
