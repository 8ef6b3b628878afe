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
//! step with every place taken and every job claimed.

use std::collections::{BTreeMap, BTreeSet, HashMap};

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
    key: (usize, usize, Vec<usize>, usize),
}

#[derive(Debug)]
pub(crate) struct Batch {
    /// In id order, so a job's number orders like its id.
    jobs: Vec<Job>,
    by_id: HashMap<JobId, usize>,
    /// The jobs holding each GPU, by job number.
    holders: HashMap<usize, Vec<usize>>,
    /// The jobs on each node, by job number.
    on_node: BTreeMap<usize, Vec<usize>>,
    /// Per class: full GPUs with a claimable holder, as `(node, GPU)`.
    wait_options: Vec<BTreeSet<(usize, usize)>>,
    /// Per class: `(job's GPUs, node, GPU, job)` for each full GPU and eligible job holding it.
    halt_options: Vec<BTreeSet<(usize, usize, usize, usize)>>,
    /// The options each GPU is in now, to take them out when it changes.
    options_of: HashMap<usize, Vec<Option_>>,
    /// Per node with jobs, per class: GPUs a session could get there, by taking a free place
    /// or waiting for or halting a job. A bound that skips most nodes without a look.
    obtainable: HashMap<usize, Vec<u32>>,
    /// Whether a GPU counts in `obtainable` now.
    counted: HashMap<usize, bool>,
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
            holders: HashMap::new(),
            on_node: BTreeMap::new(),
            wait_options: vec![BTreeSet::new(); index.class_count()],
            halt_options: vec![BTreeSet::new(); index.class_count()],
            options_of: HashMap::new(),
            obtainable: HashMap::new(),
            counted: HashMap::new(),
        };
        for job in running {
            let Some(node) = index.node_named(&job.node) else {
                continue;
            };
            let gpus: Vec<usize> = job
                .gpus
                .iter()
                .filter_map(|uuid| index.gpu_numbered(uuid))
                .filter(|&gpu| index.node_of(gpu) == node)
                .collect();
            let number = batch.jobs.len();
            for &gpu in &gpus {
                batch.holders.entry(gpu).or_default().push(number);
            }
            batch.on_node.entry(node).or_default().push(number);
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
        batch
    }

    /// Builds the one-GPU options; call once the plan's max-duration halts and the waiting
    /// sessions' claims are recorded, then [`Batch::refresh`] after every change.
    pub fn build_options(&mut self, index: &Index<'_>) {
        let mut gpus = Vec::new();
        for &node in self.on_node.keys() {
            self.obtainable.insert(node, vec![0; index.class_count()]);
            gpus.extend(index.gpus_of(node));
        }
        self.refresh(index, &gpus);
    }

    /// Brings the options of these GPUs up to date.
    pub fn refresh(&mut self, index: &Index<'_>, gpus: &[usize]) {
        for &gpu in gpus {
            for option in self.options_of.remove(&gpu).unwrap_or_default() {
                match option {
                    Option_::Wait(class, entry) => self.wait_options[class].remove(&entry),
                    Option_::Halt(class, entry) => self.halt_options[class].remove(&entry),
                };
            }
            let (class, node) = (index.class_of(gpu), index.node_of(gpu));
            let obtainable = index.free(gpu) > 0
                || self.holders.get(&gpu).is_some_and(|holders| {
                    holders
                        .iter()
                        .any(|&j| self.jobs[j].status == Status::Halting || self.jobs[j].eligible())
                });
            if let Some(counts) = self.obtainable.get_mut(&node) {
                let was = self.counted.insert(gpu, obtainable).unwrap_or(false);
                match (was, obtainable) {
                    (false, true) => counts[class] += 1,
                    (true, false) => counts[class] -= 1,
                    _ => {}
                }
            }
            if index.free(gpu) > 0 {
                continue;
            }
            let Some(holders) = self.holders.get(&gpu) else {
                continue;
            };
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
            if !options.is_empty() {
                self.options_of.insert(gpu, options);
            }
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
            let job = self.holders[&gpu]
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
    pub fn touched(&self, preemption: &Preemption) -> Vec<usize> {
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
            let nodes: Vec<usize> = match pinned {
                Some(node) => vec![node],
                None => self.on_node.keys().copied().collect(),
            };
            return nodes
                .into_iter()
                .filter_map(|node| self.on_node_(index, node, fits, count, halting))
                .min_by(|a, b| a.key.cmp(&b.key));
        }
        if count == 1 && pinned.is_none() {
            return self.preempt_one(fits);
        }
        let count = usize::try_from(count).ok()?;
        let mut best: Option<Preemption> = None;
        let nodes: Vec<usize> = match pinned {
            Some(node) => vec![node],
            None => self.on_node.keys().copied().collect(),
        };
        for node in nodes {
            let bound: u32 = self.obtainable.get(&node).map_or(0, |counts| {
                counts
                    .iter()
                    .zip(fits)
                    .filter(|(_, fits)| **fits)
                    .map(|(n, _)| n)
                    .sum()
            });
            if (bound as usize) < count {
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

    fn on_node_(
        &self,
        index: &Index<'_>,
        node: usize,
        fits: &[bool],
        count: usize,
        halting: Halting<'_>,
    ) -> Option<Preemption> {
        let jobs = self.on_node.get(&node)?;
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
            let holders = self.holders.get(&gpu).map(Vec::as_slice).unwrap_or(&[]);
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
        let mut halt_numbers: Vec<usize> = Vec::new();
        if need > 0 {
            let mut uncovered = haltable;
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
                    None => options.min_by_key(|&(j, frees)| {
                        (std::cmp::Reverse(frees), self.jobs[j].total, j)
                    })?,
                };
                halt_numbers.push(job);
                for gpu in &self.jobs[job].gpus {
                    if let Some(position) = uncovered.iter().position(|g| g == gpu) {
                        covered.push(uncovered.swap_remove(position));
                    }
                }
            }
            covered.sort_by_key(|&gpu| (index.class_of(gpu), gpu));
            gpus.extend_from_slice(&covered[..need]);
        }
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
        Some(Preemption {
            node,
            gpus,
            halt: halt_numbers.iter().map(|&j| self.jobs[j].id).collect(),
            wait_for,
            key: (halt_numbers.len(), halted_gpus, top_down, node),
            halt_numbers,
            claim_numbers,
        })
    }

    /// Records a chosen preemption: its jobs are claimed.
    pub fn commit(&mut self, preemption: &Preemption) {
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
