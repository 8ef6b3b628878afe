//! [`plan`]: which pending sessions start where, which queued jobs start, which running jobs
//! halt, now.
//!
//! In this order: running jobs past their max duration, or on GPUs whose reservation of another
//! group has started, are halted; owner groups' sessions, then their jobs, take the free GPUs
//! their group owns (`policy.rs`); sessions are served in order, one at a time, each taking the
//! best fitting place left (see the crate documentation for the rules), or, when none is left,
//! halting backfill on its group's GPUs or the fewest batch jobs that frees one (`batch.rs`);
//! then queued jobs in order, in the place left (an owner group's job halting backfill on its
//! GPUs when it finds none). A request that does not fit is skipped and the next one tried
//! (backfill). Free capacity only shrinks while planning, so a request that once found no room
//! among the GPUs it may use never will again in the same plan: later requests that may use the
//! same GPUs, as many or more, are skipped without a search, which keeps a long queue on a full
//! site cheap. The same holds for what halting jobs could free.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use ongrid_core::job::{BucketName, JobReason};
use ongrid_core::{GpuUuid, NodeName, UserName};

use crate::batch::{reached, Batch, Halting};
use crate::index::Index;
use crate::policy::Who;
use crate::site::{Action, PendingSession, QueuedJob, SiteState};

/// Per set of classes a request may take (its fitting classes), the fewest GPUs that found
/// nothing.
#[derive(Default)]
struct NoRoom(HashMap<Vec<bool>, u32>);

impl NoRoom {
    fn known(&self, fits: &[bool], count: u32) -> bool {
        self.0.get(fits).is_some_and(|&fewest| fewest <= count)
    }

    fn record(&mut self, fits: &[bool], count: u32) {
        let fewest = self.0.entry(fits.to_vec()).or_insert(count);
        *fewest = (*fewest).min(count);
    }
}

/// What a placement looks at, for sessions and jobs alike.
struct Want<'a> {
    count: u32,
    /// The classes it may take, by class number.
    fits: Vec<bool>,
    preferred_node: Option<&'a NodeName>,
    pinned_node: Option<&'a NodeName>,
    /// GPUs to take exactly, on their node, when they are all free and fit: a pinned session's
    /// previous GPUs, or the placement a session waited for.
    exactly: Option<(&'a NodeName, &'a [GpuUuid])>,
}

impl<'a> Want<'a> {
    fn session(session: &'a PendingSession, fits: Vec<bool>) -> Self {
        let exactly = match (&session.pinned_node, &session.awaiting_halt) {
            (_, Some(wait)) => Some((&wait.node, wait.gpus.as_slice())),
            (Some(pinned), None) => Some((pinned, session.previous_gpus.as_slice())),
            (None, None) => None,
        };
        Self {
            count: session.request.count,
            fits,
            preferred_node: session.preferred_node.as_ref(),
            pinned_node: session.pinned_node.as_ref(),
            exactly,
        }
    }

    fn job(job: &'a QueuedJob, fits: Vec<bool>) -> Self {
        Self {
            count: job.request.count,
            fits,
            preferred_node: None,
            pinned_node: job.pinned_node.as_ref(),
            exactly: None,
        }
    }
}

/// Plans the whole site: halts, session placements and job starts.
///
/// Returns, in this order: an [`Action::HaltJob`] per running job past its max duration or on a
/// GPU whose reservation of another group has started (by job id); an [`Action::Place`] per
/// session of an owner group that takes a free GPU its group owns, then an
/// [`Action::StartJob`] per such job; per other session that can start now, in
/// `(priority, queued_at, id)` order, an [`Action::Place`], or the [`Action::HaltJob`]s and the
/// [`Action::PlaceAfterHalt`] of a session that preempts batch work; per other queued job in
/// `(priority, queued_at, id)` order, an [`Action::CancelJob`] when its notAfter has come, an
/// [`Action::StartJob`] when it can start, or the [`Action::HaltJob`]s of the backfill an owner
/// group's job halts (it stays queued and takes those GPUs once they are free). The result
/// depends only on the contents of `site` and on `now`, not on the order of its vectors. A
/// request that is invalid (0 GPUs, or more than [`ongrid_core::GpuRequest::MAX_COUNT`]) is
/// never placed.
pub fn plan(site: &SiteState, now: DateTime<Utc>) -> Vec<Action> {
    let mut planning = Planning::new(site, now);
    planning.halt_overrunning_jobs();
    planning.keep_awaited_gpus();
    planning.batch.build_options(&planning.index);
    // Owner groups first on the free GPUs they own: their sessions, then their jobs. A site
    // where no GPU is owned skips both passes.
    if planning.index.any_owned() {
        planning.owners_sessions();
        planning.owners_jobs();
    }
    planning.sessions();
    planning.jobs();
    planning.actions
}

/// A plan in the making: the capacity left, what was decided so far, and which requests are
/// settled. Each phase of [`plan`] is one method, run in the order `plan` gives.
struct Planning<'a> {
    site: &'a SiteState,
    now: DateTime<Utc>,
    index: Index<'a>,
    batch: Batch,
    actions: Vec<Action>,
    /// Pending sessions in `(priority, queued_at, id)` order.
    queue: Vec<&'a PendingSession>,
    /// By position in `queue`: sessions waiting for jobs to halt (they keep the free GPUs of
    /// their placement) and sessions placed on their group's GPUs.
    waiting: Vec<bool>,
    placed: Vec<bool>,
    /// Queued jobs in `(priority, queued_at, id)` order.
    jobs: Vec<&'a QueuedJob>,
    /// By position in `jobs`: jobs started on their group's GPUs.
    started: Vec<bool>,
    /// Running and started jobs per user's bucket.
    in_bucket: HashMap<(&'a UserName, &'a BucketName), u32>,
    no_room: NoRoom,
    no_preemption: NoRoom,
}

impl<'a> Planning<'a> {
    fn new(site: &'a SiteState, now: DateTime<Utc>) -> Self {
        let index = Index::new(site, now);
        let batch = Batch::new(site, &index, now);
        let queue = in_order(&site.pending, |session| {
            (session.priority, session.queued_at, session.id)
        });
        let jobs = in_order(&site.queued_jobs, |job| {
            (job.priority, job.queued_at, job.id)
        });
        let mut in_bucket = HashMap::new();
        for job in &site.running_jobs {
            if let Some(bucket) = &job.bucket {
                *in_bucket.entry((&job.owner, bucket)).or_default() += 1;
            }
        }
        Self {
            site,
            now,
            index,
            batch,
            actions: Vec::new(),
            waiting: vec![false; queue.len()],
            placed: vec![false; queue.len()],
            queue,
            started: vec![false; jobs.len()],
            jobs,
            in_bucket,
            no_room: NoRoom::default(),
            no_preemption: NoRoom::default(),
        }
    }

    /// Halts running jobs past their max duration, or on a GPU whose reservation of another
    /// group has started.
    fn halt_overrunning_jobs(&mut self) {
        let site = self.site;
        let policy = &site.policy;
        let mut running: Vec<_> = site.running_jobs.iter().collect();
        running.sort_by_key(|job| job.id);
        for job in running.into_iter().filter(|job| !job.halting) {
            let reason = match job.max_duration {
                Some(max) if reached(job.started_at, Some(max), self.now) => {
                    JobReason::MaxDurationReached { max }
                }
                _ => {
                    let group = Who::job(policy, &job.id).group;
                    let Some(reservation) = job
                        .gpus
                        .iter()
                        .find_map(|gpu| policy.started_against(gpu, group, self.now))
                    else {
                        continue;
                    };
                    JobReason::ReservationStarted {
                        reservation: reservation.name.clone(),
                        group: reservation.group.clone(),
                    }
                }
            };
            self.batch.halting(job.id);
            self.actions.push(Action::HaltJob {
                job: job.id,
                reason,
            });
        }
    }

    /// Sessions waiting for jobs to halt keep the free GPUs of their placement, and the jobs
    /// they wait for.
    fn keep_awaited_gpus(&mut self) {
        let still_running: HashSet<_> = self.site.running_jobs.iter().map(|job| job.id).collect();
        for (position, session) in self.queue.iter().enumerate() {
            let Some(wait) = &session.awaiting_halt else {
                continue;
            };
            let Some(node) = self.index.node_named(&wait.node) else {
                continue;
            };
            if !wait.jobs.iter().any(|job| still_running.contains(job)) {
                continue;
            }
            self.batch.claim(wait);
            for uuid in &wait.gpus {
                if let Some(gpu) = self.index.gpu_on(node, uuid) {
                    if self.index.free(gpu) > 0 {
                        self.index.take(node, &[gpu]);
                    }
                }
            }
            self.waiting[position] = true;
        }
    }

    /// Owner groups' sessions on the free GPUs their group owns.
    fn owners_sessions(&mut self) {
        let site = self.site;
        let policy = &site.policy;
        let queue = std::mem::take(&mut self.queue);
        for (position, &session) in queue.iter().enumerate() {
            let who = Who::session(policy, &session.id);
            if session.request.validate().is_err()
                || self.waiting[position]
                || session.awaiting_halt.is_some()
                || !self.index.owns_some(&who)
            {
                continue;
            }
            let fits = self.index.fitting_classes(&session.request, &who);
            let owned = self.index.owned_classes(&fits, &who);
            if let Some((node, gpus)) = self.place(&Want::session(session, owned)) {
                self.placed[position] = true;
                self.actions.push(Action::Place {
                    session: session.id,
                    node: self.index.node_name(node).clone(),
                    gpus: self.index.uuids(&gpus),
                });
            }
        }
        self.queue = queue;
    }

    /// Owner groups' jobs on the free GPUs their group owns.
    fn owners_jobs(&mut self) {
        let site = self.site;
        let policy = &site.policy;
        let jobs = std::mem::take(&mut self.jobs);
        for (position, &job) in jobs.iter().enumerate() {
            let who = Who::job(policy, &job.id);
            if !self.index.owns_some(&who) || !self.may_start(job) {
                continue;
            }
            let fits = self.index.fitting_classes(&job.request, &who);
            let owned = self.index.owned_classes(&fits, &who);
            if let Some((node, gpus)) = self.place(&Want::job(job, owned)) {
                self.start(job, node, &gpus);
                self.started[position] = true;
            }
        }
        self.jobs = jobs;
    }

    /// The other sessions in order: each placed where it fits best, or halting batch work
    /// that frees a place.
    fn sessions(&mut self) {
        let site = self.site;
        let queue = std::mem::take(&mut self.queue);
        for (position, &session) in queue.iter().enumerate() {
            if session.request.validate().is_err()
                || self.waiting[position]
                || self.placed[position]
            {
                continue;
            }
            let who = Who::session(&site.policy, &session.id);
            let fits = self.index.fitting_classes(&session.request, &who);
            let want = Want::session(session, fits);
            if let Some((node, gpus)) = self.place(&want) {
                self.actions.push(Action::Place {
                    session: session.id,
                    node: self.index.node_name(node).clone(),
                    gpus: self.index.uuids(&gpus),
                });
            } else {
                self.preempt_for(session, &who, &want.fits);
            }
        }
    }

    /// Halts batch work for a session that found no free place: backfill on its group's GPUs
    /// first, else the fewest jobs that free one. The session is placed where they run.
    fn preempt_for(&mut self, session: &PendingSession, who: &Who<'_>, fits: &[bool]) {
        let count = session.request.count;
        let Some(pinned) = self.pinned(session.pinned_node.as_ref()) else {
            return;
        };
        let mut found = None;
        if let (Some(group), true) = (who.group, self.index.owns_some(who)) {
            let owned = self.index.owned_classes(fits, who);
            let backfill = Halting::Backfill { group };
            found = self
                .batch
                .preempt(&self.index, &owned, count, pinned, backfill)
                .map(|p| {
                    let reason = JobReason::ForOwnerWork {
                        group: group.to_owned(),
                    };
                    (p, reason)
                });
        }
        if found.is_none() {
            if pinned.is_none() && self.no_preemption.known(fits, count) {
                return;
            }
            found = self
                .batch
                .preempt(&self.index, fits, count, pinned, Halting::Interactive)
                .map(|p| {
                    (
                        p,
                        JobReason::ForInteractiveSession {
                            need: session.request,
                        },
                    )
                });
            if found.is_none() && pinned.is_none() {
                self.no_preemption.record(fits, count);
            }
        }
        let Some((preemption, reason)) = found else {
            return;
        };
        self.batch.apply(&mut self.index, &preemption);
        for &job in &preemption.halt {
            self.actions.push(Action::HaltJob {
                job,
                reason: reason.clone(),
            });
        }
        self.actions.push(Action::PlaceAfterHalt {
            session: session.id,
            node: self.index.node_name(preemption.node).clone(),
            gpus: self.index.uuids(&preemption.gpus),
            jobs: preemption.wait_for,
        });
    }

    /// The other queued jobs in order: cancelled past their notAfter, started where they fit,
    /// or, for an owner group's job, halting backfill on its group's GPUs.
    fn jobs(&mut self) {
        let site = self.site;
        let jobs = std::mem::take(&mut self.jobs);
        for (position, &job) in jobs.iter().enumerate() {
            if self.started[position] {
                continue;
            }
            if let Some(not_after) = job.not_after.filter(|&not_after| not_after <= self.now) {
                self.actions.push(Action::CancelJob {
                    job: job.id,
                    reason: JobReason::NotStartedByNotAfter { not_after },
                });
                continue;
            }
            if !self.may_start(job) {
                continue;
            }
            let who = Who::job(&site.policy, &job.id);
            let fits = self.index.fitting_classes(&job.request, &who);
            let want = Want::job(job, fits);
            if let Some((node, gpus)) = self.place(&want) {
                self.start(job, node, &gpus);
            } else {
                self.halt_backfill_for(job, &who, &want.fits);
            }
        }
    }

    /// Jobs halt nothing, but owner work halts backfill on its group's GPUs; the job stays
    /// queued and the GPUs it waits for are kept from everyone else in this plan.
    fn halt_backfill_for(&mut self, job: &QueuedJob, who: &Who<'_>, fits: &[bool]) {
        let Some(group) = who.group.filter(|_| self.index.owns_some(who)) else {
            return;
        };
        let Some(pinned) = self.pinned(job.pinned_node.as_ref()) else {
            return;
        };
        let owned = self.index.owned_classes(fits, who);
        let backfill = Halting::Backfill { group };
        let Some(preemption) =
            self.batch
                .preempt(&self.index, &owned, job.request.count, pinned, backfill)
        else {
            return;
        };
        self.batch.apply(&mut self.index, &preemption);
        for &halted in &preemption.halt {
            self.actions.push(Action::HaltJob {
                job: halted,
                reason: JobReason::ForOwnerWork {
                    group: group.to_owned(),
                },
            });
        }
    }

    /// The node a request is pinned to: `Some(None)` when it is not pinned, `None` when its
    /// node is not in the site (nothing can be halted for it).
    fn pinned(&self, name: Option<&NodeName>) -> Option<Option<usize>> {
        match name {
            Some(name) => self.index.node_named(name).map(Some),
            None => Some(None),
        }
    }

    /// Whether a queued job may start now: inside its notBefore/notAfter window, a valid
    /// request, and room in its bucket.
    fn may_start(&self, job: &QueuedJob) -> bool {
        let bucket_full = job.bucket.as_ref().is_some_and(|b| {
            self.in_bucket
                .get(&(&job.owner, &b.name))
                .is_some_and(|&n| n >= b.max)
        });
        job.not_after.is_none_or(|not_after| not_after > self.now)
            && job
                .not_before
                .is_none_or(|not_before| not_before <= self.now)
            && job.request.validate().is_ok()
            && !bucket_full
    }

    /// Places one request in the free capacity, and tells the batch options so.
    fn place(&mut self, want: &Want<'_>) -> Option<(usize, Vec<usize>)> {
        let (node, gpus) = place_one(&mut self.index, &mut self.no_room, want)?;
        self.batch.refresh(&self.index, &gpus);
        Some((node, gpus))
    }

    /// Starts `job` on `gpus` of `node`, counting it in its bucket.
    fn start(&mut self, job: &'a QueuedJob, node: usize, gpus: &[usize]) {
        if let Some(bucket) = &job.bucket {
            *self
                .in_bucket
                .entry((&job.owner, &bucket.name))
                .or_default() += 1;
        }
        self.actions.push(Action::StartJob {
            job: job.id,
            node: self.index.node_name(node).clone(),
            gpus: self.index.uuids(gpus),
        });
    }
}

/// `items` in `key` order, as a stable sort would put them, computing each key once.
fn in_order<T, K: Ord>(items: &[T], key: impl Fn(&T) -> K) -> Vec<&T> {
    let mut keyed: Vec<(K, usize)> = items
        .iter()
        .enumerate()
        .map(|(position, item)| (key(item), position))
        .collect();
    keyed.sort_unstable();
    keyed
        .into_iter()
        .map(|(_, position)| &items[position])
        .collect()
}

/// Places one request in the free capacity (its node and GPUs, by number), or records that its
/// classes found no room.
fn place_one(
    index: &mut Index<'_>,
    no_room: &mut NoRoom,
    want: &Want<'_>,
) -> Option<(usize, Vec<usize>)> {
    if no_room.known(&want.fits, want.count) && want.pinned_node.is_none() {
        return None;
    }
    match choose(index, want) {
        Some((node, gpus)) => {
            index.take(node, &gpus);
            Some((node, gpus))
        }
        // A pinned request found no room on one node only: others may still have some.
        None if want.pinned_node.is_some() => None,
        None => {
            no_room.record(&want.fits, want.count);
            None
        }
    }
}

/// The node and GPUs for one request, or `None` when nothing fits now.
fn choose(index: &Index<'_>, want: &Want<'_>) -> Option<(usize, Vec<usize>)> {
    let fits = &want.fits;
    let count = want.count;
    if let Some((name, gpus)) = want.exactly {
        let allowed = want.pinned_node.is_none_or(|pinned| pinned == name);
        if let Some(node) = index.node_named(name).filter(|_| allowed) {
            if let Some(gpus) = index.these_free_gpus_on(node, fits, gpus, count) {
                return Some((node, gpus));
            }
        }
    }
    if let Some(pinned) = want.pinned_node {
        let node = index.node_named(pinned)?;
        let gpus = index.least_free_gpus_on(node, fits, count)?;
        return Some((node, gpus));
    }
    if let Some(preferred) = want.preferred_node.and_then(|name| index.node_named(name)) {
        if let Some(gpus) = index.least_free_gpus_on(preferred, fits, count) {
            return Some((preferred, gpus));
        }
    }
    if count == 1 {
        let gpu = index.least_free_gpu(fits)?;
        return Some((index.node_of(gpu), vec![gpu]));
    }
    let node = index.best_node(fits, count)?;
    let gpus = index.least_free_gpus_on(node, fits, count)?;
    Some((node, gpus))
}

#[cfg(test)]
mod tests {
    use ongrid_core::Sharing::{Any, Exclusive, Shared};

    use super::*;
    use crate::testing::*;

    fn site(nodes: Vec<crate::NodeState>, pending: Vec<PendingSession>) -> SiteState {
        SiteState {
            nodes,
            pending,
            ..SiteState::default()
        }
    }

    fn one() -> ongrid_core::GpuRequest {
        request(1, None, None, Exclusive)
    }

    #[test]
    fn a_single_gpu_goes_to_the_least_capable_gpu_that_fits() {
        let nodes = vec![
            node("n1", vec![h100(1), a100_80(2)]),
            node("n2", vec![a100(3), t4(4)]),
        ];
        let cases = [
            (request(1, None, None, Exclusive), 4),
            (request(1, Some("8.0"), None, Exclusive), 3),
            (request(1, Some("8.0"), Some("80G"), Exclusive), 2),
            (request(1, Some("9.0"), None, Exclusive), 1),
            (request(1, None, Some("80G"), Exclusive), 2),
        ];
        for (request, expected) in cases {
            let node = if expected <= 2 { "n1" } else { "n2" };
            let actions = plan(&site(nodes.clone(), vec![session(1, request)]), at(100));
            assert_eq!(actions, [place(1, node, &[expected])], "{request:?}");
        }
    }

    #[test]
    fn equal_gpus_are_taken_in_node_name_then_uuid_order() {
        let nodes = vec![
            node("n2", vec![a100(1)]),
            node("n1", vec![a100(3), a100(2)]),
        ];
        let pending = (1..=3).map(|n| session(n, one())).collect();
        assert_eq!(
            plan(&site(nodes, pending), at(100)),
            [
                place(1, "n1", &[2]),
                place(2, "n1", &[3]),
                place(3, "n2", &[1])
            ]
        );
    }

    #[test]
    fn a_multi_gpu_session_goes_to_the_node_whose_set_is_least_capable_from_the_top_down() {
        // For 2 GPUs n1 offers {T4, T4} and n2 {A100, A100}: n1's best is less capable.
        // For 3 GPUs n1 must add an H100, n2 offers three A100s: n2's most capable is less.
        let nodes = vec![
            node("n1", vec![t4(1), t4(2), h100(3), h100(4)]),
            node("n2", vec![a100(5), a100(6), a100(7), a100(8)]),
        ];
        let two = request(2, None, None, Exclusive);
        let three = request(3, None, None, Exclusive);
        assert_eq!(
            plan(&site(nodes.clone(), vec![session(1, two)]), at(100)),
            [place(1, "n1", &[1, 2])]
        );
        assert_eq!(
            plan(&site(nodes, vec![session(1, three)]), at(100)),
            [place(1, "n2", &[5, 6, 7])]
        );
    }

    #[test]
    fn multi_gpu_sets_with_the_same_top_compare_the_next_gpu_before_the_node_name() {
        let nodes = vec![
            node("n1", vec![a100(1), h100(2)]),
            node("n2", vec![t4(3), h100(4)]),
        ];
        let two = request(2, None, None, Exclusive);
        assert_eq!(
            plan(&site(nodes, vec![session(1, two)]), at(100)),
            [place(1, "n2", &[3, 4])]
        );
    }

    #[test]
    fn a_multi_gpu_session_never_spans_nodes() {
        let nodes = vec![node("n1", vec![a100(1)]), node("n2", vec![a100(2)])];
        let two = request(2, None, None, Exclusive);
        assert_eq!(plan(&site(nodes, vec![session(1, two)]), at(100)), []);
    }

    #[test]
    fn an_exclusive_gpu_holds_one_session_and_a_shared_one_up_to_its_limit() {
        let mut busy = a100(2);
        busy.used = 1;
        let nodes = vec![node(
            "n1",
            vec![a100(1), busy, gpu(3, "7.5", "16G", "shared:3")],
        )];
        let pending = vec![
            session(1, one()),
            session(2, one()),
            session(3, request(1, None, None, Shared)),
            session(4, request(1, None, None, Shared)),
            session(5, request(1, None, None, Shared)),
            session(6, request(1, None, None, Shared)),
        ];
        assert_eq!(
            plan(&site(nodes, pending), at(100)),
            [
                place(1, "n1", &[1]),
                place(3, "n1", &[3]),
                place(4, "n1", &[3]),
                place(5, "n1", &[3]),
            ]
        );
    }

    #[test]
    fn a_gpu_used_beyond_a_shrunk_capacity_is_full() {
        let mut shrunk = gpu(1, "8.0", "40G", "shared:2");
        shrunk.used = 4;
        let nodes = vec![node("n1", vec![shrunk])];
        let pending = vec![session(1, request(1, None, None, Any))];
        assert_eq!(plan(&site(nodes, pending), at(100)), []);
    }

    #[test]
    fn offline_nodes_and_unhealthy_gpus_get_nothing() {
        let mut offline = node("n1", vec![t4(1)]);
        offline.online = false;
        let mut broken = t4(2);
        broken.healthy = false;
        let nodes = vec![offline, node("n2", vec![broken, h100(3)])];
        let pending = vec![session(1, one()), session(2, one())];
        assert_eq!(plan(&site(nodes, pending), at(100)), [place(1, "n2", &[3])]);
    }

    #[test]
    fn drained_nodes_and_gpus_get_nothing_until_undrained() {
        let mut drained_node = node("n1", vec![t4(1)]);
        drained_node.drained = true;
        let mut drained_gpu = t4(2);
        drained_gpu.drained = true;
        let nodes = vec![drained_node, node("n2", vec![drained_gpu, h100(3)])];
        let pending = vec![session(1, one()), session(2, one())];
        let state = site(nodes, pending);
        assert_eq!(plan(&state, at(100)), [place(1, "n2", &[3])]);
        let mut undrained = state.clone();
        undrained.nodes[0].drained = false;
        undrained.nodes[1].gpus[0].drained = false;
        assert_eq!(
            plan(&undrained, at(100)),
            [place(1, "n1", &[1]), place(2, "n2", &[2])]
        );
    }

    #[test]
    fn sharing_decides_which_modes_a_request_accepts() {
        let shared = gpu(1, "8.0", "40G", "shared:2");
        let whole = a100(2);
        let nodes = vec![node("n1", vec![whole, shared])];
        let cases = [(Exclusive, Some(2)), (Shared, Some(1)), (Any, Some(1))];
        for (sharing, expected) in cases {
            let pending = vec![session(1, request(1, None, None, sharing))];
            let actions = plan(&site(nodes.clone(), pending), at(100));
            let expected: Vec<_> = expected.map(|g| place(1, "n1", &[g])).into_iter().collect();
            assert_eq!(actions, expected, "{sharing}");
        }
    }

    #[test]
    fn any_takes_a_share_before_a_whole_gpu_of_the_same_class_but_not_a_bigger_one() {
        let nodes = vec![node(
            "n1",
            vec![
                a100(1),
                gpu(2, "8.0", "40G", "shared:2"),
                gpu(3, "8.0", "40G", "shared:4"),
                gpu(4, "9.0", "80G", "shared:4"),
                t4(5),
            ],
        )];
        let pending = vec![
            session(1, request(1, Some("8.0"), None, Any)),
            session(2, request(1, None, None, Any)),
        ];
        assert_eq!(
            plan(&site(nodes, pending), at(100)),
            [place(1, "n1", &[3]), place(2, "n1", &[5])]
        );
    }

    #[test]
    fn shared_gpus_are_packed_before_an_empty_one_is_started() {
        let mut busy = gpu(9, "8.0", "40G", "shared:4");
        busy.used = 2;
        let nodes = vec![
            node("n1", vec![gpu(1, "8.0", "40G", "shared:4")]),
            node("n2", vec![busy]),
        ];
        let pending = (1..=3)
            .map(|n| session(n, request(1, None, None, Shared)))
            .collect();
        assert_eq!(
            plan(&site(nodes, pending), at(100)),
            [
                place(1, "n2", &[9]),
                place(2, "n2", &[9]),
                place(3, "n1", &[1])
            ]
        );
    }

    #[test]
    fn first_come_first_served_by_queue_time_then_id() {
        let nodes = vec![node("n1", vec![a100(1)])];
        let mut early = session(9, one());
        early.queued_at = at(1);
        let late = session(2, one());
        let tied = session(1, one());
        let mut tied_late = session(2, one());
        tied_late.queued_at = at(1);
        assert_eq!(
            plan(&site(nodes.clone(), vec![late, early]), at(100)),
            [place(9, "n1", &[1])]
        );
        assert_eq!(
            plan(&site(nodes, vec![tied_late, tied]), at(100)),
            [place(1, "n1", &[1])]
        );
    }

    #[test]
    fn a_session_that_does_not_fit_does_not_block_later_ones() {
        let nodes = vec![node("n1", vec![a100(1), h100(2)])];
        let pending = vec![
            session(1, request(3, None, None, Exclusive)),
            session(2, request(2, Some("9.0"), None, Exclusive)),
            session(3, request(1, Some("9.0"), None, Exclusive)),
            session(4, request(1, Some("9.0"), None, Exclusive)),
            session(5, one()),
        ];
        assert_eq!(
            plan(&site(nodes, pending), at(100)),
            [place(3, "n1", &[2]), place(5, "n1", &[1])]
        );
    }

    #[test]
    fn the_preferred_node_wins_when_it_can_take_the_session() {
        let nodes = vec![
            node("n1", vec![t4(1), a100(5)]),
            node("n2", vec![h100(2), a100(3), t4(4)]),
        ];
        let prefer = |n, request, name: &str| PendingSession {
            preferred_node: Some(node_name(name)),
            ..session(n, request)
        };
        let pending = vec![
            // n1 would win the tie on name; the preference takes n2's least two.
            prefer(1, request(2, None, None, Exclusive), "n2"),
            // An unknown node is no preference.
            prefer(2, one(), "n3"),
            // n1 has no 9.0 GPU: anywhere else that fits.
            prefer(3, request(1, Some("9.0"), None, Exclusive), "n1"),
            // n2 is full by now.
            prefer(4, one(), "n2"),
        ];
        assert_eq!(
            plan(&site(nodes, pending), at(100)),
            [
                place(1, "n2", &[4, 3]),
                place(2, "n1", &[1]),
                place(3, "n2", &[2]),
                place(4, "n1", &[5]),
            ]
        );
    }

    #[test]
    fn a_pinned_session_goes_only_to_its_node_and_waits_for_it() {
        let nodes = vec![
            node("n1", vec![t4(1), a100(2)]),
            node("n2", vec![t4(3), t4(4)]),
        ];
        let pin = |n, name: &str| PendingSession {
            pinned_node: Some(node_name(name)),
            // A pin wins over a preference.
            preferred_node: Some(node_name("n1")),
            ..session(n, one())
        };
        let pending = vec![
            pin(1, "n2"),
            pin(2, "n2"),
            // n2 is full now: it waits, though n1 has room...
            pin(3, "n2"),
            // ...and that does not stop an equal unpinned request from taking n1's room.
            session(4, one()),
            // An unknown node takes nothing.
            pin(5, "n9"),
        ];
        assert_eq!(
            plan(&site(nodes, pending), at(100)),
            [
                place(1, "n2", &[3]),
                place(2, "n2", &[4]),
                place(4, "n1", &[1]),
            ]
        );
    }

    #[test]
    fn a_pinned_session_gets_its_previous_gpus_back_when_they_are_free() {
        let nodes = vec![node("n1", vec![t4(1), t4(2), a100(3), a100(4)])];
        let back = |n, count, previous: &[u32]| PendingSession {
            pinned_node: Some(node_name("n1")),
            previous_gpus: previous.iter().map(|&g| uuid(g)).collect(),
            ..session(n, request(count, None, None, Exclusive))
        };
        let pending = vec![
            // Its old A100 rather than the least capable free GPU.
            back(1, 1, &[4]),
            // Both old GPUs, in their old order.
            back(2, 2, &[3, 1]),
            // GPU 4 is taken now: the least capable free GPU instead.
            back(3, 1, &[4]),
        ];
        assert_eq!(
            plan(&site(nodes, pending), at(100)),
            [
                place(1, "n1", &[4]),
                place(2, "n1", &[3, 1]),
                place(3, "n1", &[2]),
            ]
        );
        // A previous GPU that no longer fits the request, or a count that differs, is no claim.
        let nodes = vec![node("n1", vec![t4(1), a100(3)])];
        let old_t4 = back(1, 1, &[1]);
        let needs_ampere = PendingSession {
            request: request(1, Some("8.0"), None, Exclusive),
            ..old_t4.clone()
        };
        assert_eq!(
            plan(&site(nodes.clone(), vec![needs_ampere]), at(100)),
            [place(1, "n1", &[3])]
        );
        let two = PendingSession {
            request: request(2, None, None, Exclusive),
            ..old_t4
        };
        assert_eq!(
            plan(&site(nodes, vec![two]), at(100)),
            [place(1, "n1", &[1, 3])]
        );
    }

    #[test]
    fn a_pinned_session_waits_while_its_node_is_offline() {
        let mut offline = node("n1", vec![t4(1)]);
        offline.online = false;
        let nodes = vec![offline, node("n2", vec![t4(2)])];
        let pinned = PendingSession {
            pinned_node: Some(node_name("n1")),
            ..session(1, one())
        };
        assert_eq!(plan(&site(nodes, vec![pinned]), at(100)), []);
    }

    #[test]
    fn invalid_requests_are_never_placed() {
        let nodes = vec![node("n1", vec![a100(1)])];
        let pending = vec![session(1, request(0, None, None, Any))];
        assert_eq!(plan(&site(nodes, pending), at(100)), []);
    }

    #[test]
    fn a_shape_with_no_room_for_many_gpus_still_places_fewer() {
        let nodes = vec![node("n1", vec![a100(1), a100(2)])];
        let pending = vec![
            session(1, request(4, Some("8.0"), None, Exclusive)),
            session(2, request(2, Some("8.0"), None, Exclusive)),
            session(3, request(1, Some("8.0"), None, Exclusive)),
        ];
        assert_eq!(
            plan(&site(nodes, pending), at(100)),
            [place(2, "n1", &[1, 2])]
        );
    }

    #[test]
    fn placing_updates_what_later_multi_gpu_sessions_see() {
        // Session 1 takes a T4 from n1, so n1 no longer has two T4s and session 2 must go to
        // n2; session 3 then finds no node with two free T4s and takes n1's T4 and A100.
        let nodes = vec![
            node("n1", vec![t4(1), t4(2), a100(3)]),
            node("n2", vec![t4(4), t4(5)]),
        ];
        let two = request(2, None, None, Exclusive);
        let pending = vec![session(1, one()), session(2, two), session(3, two)];
        assert_eq!(
            plan(&site(nodes, pending), at(100)),
            [
                place(1, "n1", &[1]),
                place(2, "n2", &[4, 5]),
                place(3, "n1", &[2, 3]),
            ]
        );
    }

    // -----------------------------------------------------------------------------------------
    // Jobs.

    fn jobs_site(
        nodes: Vec<crate::NodeState>,
        pending: Vec<PendingSession>,
        queued_jobs: Vec<crate::QueuedJob>,
        running_jobs: Vec<crate::RunningJob>,
    ) -> SiteState {
        SiteState {
            nodes,
            pending,
            queued_jobs,
            running_jobs,
            ..SiteState::default()
        }
    }

    #[test]
    fn sessions_are_served_before_jobs_and_neither_overallocates() {
        let nodes = vec![node("n1", vec![t4(1), a100(2)])];
        let jobs = vec![queued_job(1, one()), queued_job(2, one())];
        // The job was queued first, the session still wins the least GPU.
        let pending = vec![session(5, one())];
        assert_eq!(
            plan(&jobs_site(nodes, pending, jobs, vec![]), at(100)),
            [place(5, "n1", &[1]), start(1, "n1", &[2])]
        );
    }

    #[test]
    fn not_before_waits_and_not_after_cancels() {
        let nodes = vec![node("n1", vec![t4(1), t4(2)])];
        let mut early = queued_job(1, one());
        early.not_before = Some(at(200));
        let mut late = queued_job(2, one());
        late.not_after = Some(at(100));
        let mut fine = queued_job(3, one());
        fine.not_after = Some(at(101));
        let site = jobs_site(nodes, vec![], vec![early, late, fine], vec![]);
        assert_eq!(
            plan(&site, at(100)),
            [
                Action::CancelJob {
                    job: job_id(2),
                    reason: JobReason::NotStartedByNotAfter { not_after: at(100) },
                },
                start(3, "n1", &[1]),
            ]
        );
        assert_eq!(plan(&site, at(200))[0], start(1, "n1", &[1]));
    }

    #[test]
    fn buckets_cap_running_jobs_per_owner_and_name() {
        let nodes = vec![node("n1", vec![t4(1), t4(2), t4(3), hold(t4(4))])];
        let mut running = running_job(9, "n1", &[4], 0, 0);
        running.bucket = Some(BucketName::parse("sweep").unwrap());
        let in_sweep = |n| crate::QueuedJob {
            bucket: bucket("sweep:2"),
            ..queued_job(n, one())
        };
        let bob = crate::QueuedJob {
            owner: user("bob"),
            ..in_sweep(3)
        };
        let other = crate::QueuedJob {
            bucket: bucket("eval:1"),
            ..queued_job(4, one())
        };
        let site = jobs_site(
            nodes,
            vec![],
            vec![in_sweep(1), in_sweep(2), bob, other],
            vec![running],
        );
        assert_eq!(
            plan(&site, at(100)),
            [
                start(1, "n1", &[1]),
                start(3, "n1", &[2]),
                start(4, "n1", &[3])
            ]
        );
    }

    #[test]
    fn a_job_past_its_max_duration_is_halted_once() {
        let nodes = vec![node("n1", vec![hold(t4(1)), hold(t4(2))])];
        let mut due = running_job(1, "n1", &[1], 0, 0);
        due.max_duration = Some(ongrid_core::HumanDuration::from_secs(100));
        let mut halting = due.clone();
        halting.id = job_id(2);
        halting.gpus = vec![uuid(2)];
        halting.halting = true;
        let mut young = due.clone();
        young.id = job_id(3);
        young.started_at = at(1);
        let site = jobs_site(nodes, vec![], vec![], vec![due, halting, young]);
        assert_eq!(
            plan(&site, at(100)),
            [Action::HaltJob {
                job: job_id(1),
                reason: JobReason::MaxDurationReached {
                    max: ongrid_core::HumanDuration::from_secs(100)
                },
            }]
        );
    }

    #[test]
    fn a_session_halts_the_fewest_jobs_past_their_min_duration() {
        // n1: two one-GPU jobs; n2: one two-GPU job. A two-GPU session halts the one job.
        let nodes = vec![
            node("n1", vec![hold(a100(1)), hold(a100(2))]),
            node("n2", vec![hold(a100(3)), hold(a100(4))]),
        ];
        let running = vec![
            running_job(1, "n1", &[1], 0, 60),
            running_job(2, "n1", &[2], 0, 60),
            running_job(3, "n2", &[3, 4], 0, 60),
        ];
        let two = request(2, None, None, Exclusive);
        let site = jobs_site(nodes, vec![session(1, two)], vec![], running);
        assert_eq!(
            plan(&site, at(100)),
            [halt_for(3, two), place_after(1, "n2", &[3, 4], &[3])]
        );
        let Action::HaltJob { reason, .. } = halt_for(3, two) else {
            unreachable!()
        };
        assert_eq!(
            reason.to_string(),
            "halted for an interactive session needing 2 GPUs"
        );
    }

    #[test]
    fn a_job_within_its_min_duration_is_never_halted() {
        let nodes = vec![node("n1", vec![hold(a100(1)), hold(a100(2))])];
        let running = vec![
            running_job(1, "n1", &[1], 0, 3600),
            running_job(2, "n1", &[2], 0, 60),
        ];
        let two = request(2, None, None, Exclusive);
        // Halting job 2 alone would not let the session start: nothing is halted.
        let site = jobs_site(
            nodes.clone(),
            vec![session(1, two)],
            vec![],
            running.clone(),
        );
        assert_eq!(plan(&site, at(100)), []);
        // One GPU: job 2 (past its minimum) goes, job 1 stays.
        let site = jobs_site(nodes, vec![session(1, one())], vec![], running);
        assert_eq!(
            plan(&site, at(100)),
            [halt_for(2, one()), place_after(1, "n1", &[2], &[2])]
        );
    }

    #[test]
    fn a_session_takes_free_gpus_and_halts_only_what_is_missing() {
        let nodes = vec![node("n1", vec![a100(1), hold(a100(2)), hold(h100(3))])];
        let running = vec![
            running_job(1, "n1", &[2], 0, 0),
            running_job(2, "n1", &[3], 0, 0),
        ];
        let two = request(2, None, None, Exclusive);
        // A queued job gets nothing: the free GPU is kept for the session.
        let site = jobs_site(
            nodes,
            vec![session(1, two)],
            vec![queued_job(1, one())],
            running,
        );
        assert_eq!(
            plan(&site, at(100)),
            [halt_for(1, two), place_after(1, "n1", &[1, 2], &[1])]
        );
    }

    #[test]
    fn a_session_waits_for_a_job_halting_already_instead_of_halting_another() {
        let nodes = vec![node("n1", vec![hold(a100(1)), hold(a100(2))])];
        let mut halting = running_job(1, "n1", &[1], 0, 0);
        halting.halting = true;
        let running = vec![halting, running_job(2, "n1", &[2], 0, 0)];
        let site = jobs_site(
            nodes,
            vec![session(1, one()), session(2, one()), session(3, one())],
            vec![],
            running,
        );
        assert_eq!(
            plan(&site, at(100)),
            [
                place_after(1, "n1", &[1], &[1]),
                halt_for(2, one()),
                place_after(2, "n1", &[2], &[2]),
            ]
        );
    }

    #[test]
    fn a_waiting_session_keeps_its_gpus_and_starts_there_once_the_jobs_are_gone() {
        let wait = crate::HaltWait {
            node: node_name("n1"),
            gpus: vec![uuid(1), uuid(2)],
            jobs: vec![job_id(1)],
        };
        let waiting = PendingSession {
            awaiting_halt: Some(wait),
            ..session(1, request(2, None, None, Exclusive))
        };
        let mut halting = running_job(1, "n1", &[2], 0, 0);
        halting.halting = true;
        // Still halting: nothing for the session, and GPU 1 is not given to anyone else.
        let site = jobs_site(
            vec![node("n1", vec![t4(1), hold(a100(2)), h100(3)])],
            vec![waiting.clone(), session(2, one())],
            vec![queued_job(1, one())],
            vec![halting],
        );
        assert_eq!(plan(&site, at(100)), [place(2, "n1", &[3])]);
        // HALTED: it takes exactly the GPUs it waited for, before the earlier free GPU 3.
        let site = jobs_site(
            vec![node("n1", vec![t4(1), a100(2), t4(3)])],
            vec![waiting],
            vec![],
            vec![],
        );
        assert_eq!(plan(&site, at(100)), [place(1, "n1", &[1, 2])]);
    }

    #[test]
    fn a_pinned_session_preempts_only_on_its_node() {
        let nodes = vec![node("n1", vec![hold(t4(1))]), node("n2", vec![hold(t4(2))])];
        let running = vec![
            running_job(1, "n1", &[1], 0, 0),
            running_job(2, "n2", &[2], 0, 0),
        ];
        let pinned = PendingSession {
            pinned_node: Some(node_name("n2")),
            ..session(1, one())
        };
        let site = jobs_site(nodes, vec![pinned], vec![], running);
        assert_eq!(
            plan(&site, at(100)),
            [halt_for(2, one()), place_after(1, "n2", &[2], &[2])]
        );
    }

    #[test]
    fn a_pinned_job_starts_only_on_its_node_and_waits_for_it() {
        let nodes = vec![
            node("n1", vec![hold(t4(1))]),
            node("n2", vec![t4(2), t4(3)]),
        ];
        let pinned = crate::QueuedJob {
            pinned_node: Some(node_name("n1")),
            ..queued_job(1, one())
        };
        // n1 is full: the pinned job waits, though n2 has room; a later job takes n2.
        let site = jobs_site(
            nodes,
            vec![],
            vec![pinned.clone(), queued_job(2, one())],
            vec![],
        );
        assert_eq!(plan(&site, at(100)), [start(2, "n2", &[2])]);
        // Pinned to n2, it goes there.
        let to_n2 = crate::QueuedJob {
            pinned_node: Some(node_name("n2")),
            ..pinned.clone()
        };
        let nodes = vec![node("n1", vec![t4(1)]), node("n2", vec![t4(2)])];
        let site = jobs_site(nodes, vec![], vec![to_n2], vec![]);
        assert_eq!(plan(&site, at(100)), [start(1, "n2", &[2])]);
        // Its node offline: it waits.
        let mut offline = node("n1", vec![t4(1)]);
        offline.online = false;
        let site = jobs_site(
            vec![offline, node("n2", vec![t4(2)])],
            vec![],
            vec![pinned],
            vec![],
        );
        assert_eq!(plan(&site, at(100)), []);
    }

    #[test]
    fn jobs_never_preempt() {
        let nodes = vec![node("n1", vec![hold(t4(1))])];
        let site = jobs_site(
            nodes,
            vec![],
            vec![queued_job(2, one())],
            vec![running_job(1, "n1", &[1], 0, 0)],
        );
        assert_eq!(plan(&site, at(100)), []);
    }

    // -----------------------------------------------------------------------------------------
    // Owned GPUs and reservations.

    use crate::policy::{Access, Policy, Reservation};

    fn access(group: &str) -> Access {
        Access {
            group: Some(group.to_owned()),
            ..Access::default()
        }
    }

    /// GPU 1 owned by cms; sessions 1.. and jobs 1.. of the groups given.
    fn owned_site(
        nodes: Vec<crate::NodeState>,
        sessions: &[(u32, &str)],
        jobs: &[(u32, &str)],
        running: Vec<crate::RunningJob>,
    ) -> SiteState {
        let mut policy = Policy {
            owners: [(uuid(1), "cms".to_owned())].into(),
            ..Policy::default()
        };
        for &(n, group) in sessions {
            policy.sessions.insert(session_id(n), access(group));
        }
        for &(n, group) in jobs {
            policy.jobs.insert(job_id(n), access(group));
        }
        let queued = jobs
            .iter()
            .filter(|(n, _)| !running.iter().any(|r| r.id == job_id(*n)))
            .map(|&(n, _)| queued_job(n, one()))
            .collect();
        SiteState {
            nodes,
            pending: sessions.iter().map(|&(n, _)| session(n, one())).collect(),
            queued_jobs: queued,
            running_jobs: running,
            policy,
        }
    }

    #[test]
    fn owners_go_first_on_their_gpus_and_others_sessions_stay_off_them() {
        // GPU 1 (a T4, the least capable) is owned by cms. Atlas's session 1 came first but
        // may not take it; cms's session 2 takes it before anyone else.
        let nodes = vec![node("n1", vec![t4(1), a100(2)])];
        let site = owned_site(nodes.clone(), &[(1, "atlas"), (2, "cms")], &[], vec![]);
        assert_eq!(
            plan(&site, at(100)),
            [place(2, "n1", &[1]), place(1, "n1", &[2])]
        );
        // Without a free GPU of its own, atlas's session waits rather than take cms's GPU.
        let site = owned_site(
            vec![node("n1", vec![t4(1), hold(a100(2))])],
            &[(1, "atlas")],
            &[],
            vec![],
        );
        assert_eq!(plan(&site, at(100)), []);
        // Unless the site allows sessions on owned GPUs.
        let mut allowed = site;
        allowed.policy.sessions_on_owned_gpus = true;
        assert_eq!(plan(&allowed, at(100)), [place(1, "n1", &[1])]);
        // An owner's job also goes first there, before an earlier job of another group, which
        // takes the unowned GPU.
        let site = owned_site(nodes, &[], &[(1, "atlas"), (2, "cms")], vec![]);
        assert_eq!(
            plan(&site, at(100)),
            [start(2, "n1", &[1]), start(1, "n1", &[2])]
        );
    }

    #[test]
    fn others_jobs_backfill_owned_gpus_and_are_halted_when_owner_work_arrives() {
        // Atlas's job may run on cms's GPU as backfill.
        let site = owned_site(vec![node("n1", vec![t4(1)])], &[], &[(1, "atlas")], vec![]);
        assert_eq!(plan(&site, at(100)), [start(1, "n1", &[1])]);
        // Then a cms session arrives: the backfill is halted at once, its min duration of an
        // hour notwithstanding, and the session waits for exactly that GPU.
        let backfill = running_job(1, "n1", &[1], 90, 3600);
        let owner_wins = |reason_group: &str| Action::HaltJob {
            job: job_id(1),
            reason: JobReason::ForOwnerWork {
                group: reason_group.to_owned(),
            },
        };
        let site = owned_site(
            vec![node("n1", vec![hold(t4(1))])],
            &[(2, "cms")],
            &[(1, "atlas")],
            vec![backfill.clone()],
        );
        assert_eq!(
            plan(&site, at(100)),
            [owner_wins("cms"), place_after(2, "n1", &[1], &[1])]
        );
        // A cms job halts it too, and stays queued; the next plan, with the backfill still
        // halting, halts nothing more and gives the GPU to nobody else.
        let mut site = owned_site(
            vec![node("n1", vec![hold(t4(1))])],
            &[],
            &[(1, "atlas"), (2, "cms")],
            vec![backfill.clone()],
        );
        assert_eq!(plan(&site, at(100)), [owner_wins("cms")]);
        site.running_jobs[0].halting = true;
        site.queued_jobs.push(queued_job(4, one()));
        site.policy.jobs.insert(job_id(4), access("atlas"));
        assert_eq!(plan(&site, at(101)), []);
        // Once HALTED, the GPU goes to the owner's job, not to the earlier job of atlas.
        site.nodes[0].gpus[0].used = 0;
        site.running_jobs.clear();
        site.queued_jobs[1].queued_at = at(0);
        assert_eq!(plan(&site, at(102)), [start(2, "n1", &[1])]);
        // The owners' own jobs on their GPUs are never backfill.
        let own = owned_site(
            vec![node("n1", vec![hold(t4(1))])],
            &[(2, "cms")],
            &[(1, "cms")],
            vec![running_job(1, "n1", &[1], 0, 3600)],
        );
        assert_eq!(plan(&own, at(100)), []);
    }

    fn reserved_site(jobs: Vec<(u32, Option<u64>)>, now_reserved: (i64, i64)) -> SiteState {
        let mut policy = Policy {
            reservations: vec![Reservation {
                name: "school".to_owned(),
                group: "cms".to_owned(),
                gpus: vec![uuid(1)],
                from: at(now_reserved.0),
                to: at(now_reserved.1),
            }],
            ..Policy::default()
        };
        for &(n, max) in &jobs {
            policy.jobs.insert(
                job_id(n),
                Access {
                    max_duration: max.map(ongrid_core::HumanDuration::from_secs),
                    ..access("atlas")
                },
            );
        }
        SiteState {
            nodes: vec![node("n1", vec![t4(1)])],
            queued_jobs: jobs.iter().map(|&(n, _)| queued_job(n, one())).collect(),
            policy,
            ..SiteState::default()
        }
    }

    #[test]
    fn a_job_starts_on_reserved_gpus_only_when_it_ends_before_the_window() {
        // The window opens at 200. At 100, a job of 100 s ends in time; one of 101 s does not;
        // one with no max duration never does.
        for (max, starts) in [(Some(100), true), (Some(101), false), (None, false)] {
            let site = reserved_site(vec![(1, max)], (200, 300));
            let expected = if starts {
                vec![start(1, "n1", &[1])]
            } else {
                vec![]
            };
            assert_eq!(plan(&site, at(100)), expected, "max duration {max:?}");
        }
        // Within the window nothing of others starts; at its end, it does.
        let site = reserved_site(vec![(1, Some(1))], (200, 300));
        assert_eq!(plan(&site, at(200)), []);
        assert_eq!(plan(&site, at(299)), []);
        assert_eq!(plan(&site, at(300)), [start(1, "n1", &[1])]);
    }

    #[test]
    fn running_jobs_of_others_are_halted_when_a_reservation_starts() {
        let mut site = reserved_site(vec![], (200, 300));
        site.nodes[0].gpus[0].used = 1;
        site.running_jobs = vec![running_job(1, "n1", &[1], 0, 3600)];
        site.policy.jobs.insert(job_id(1), access("atlas"));
        assert_eq!(plan(&site, at(199)), []);
        let halted = Action::HaltJob {
            job: job_id(1),
            reason: JobReason::ReservationStarted {
                reservation: "school".to_owned(),
                group: "cms".to_owned(),
            },
        };
        assert_eq!(plan(&site, at(200)), std::slice::from_ref(&halted));
        assert_eq!(
            halted_reason(&halted),
            "halted: reservation school of group cms started on its GPUs"
        );
        // Once halting, it is not asked again; the group's own jobs are never halted for it.
        site.running_jobs[0].halting = true;
        assert_eq!(plan(&site, at(250)), []);
        site.running_jobs[0].halting = false;
        site.policy.jobs.insert(job_id(1), access("cms"));
        assert_eq!(plan(&site, at(250)), []);
    }

    fn halted_reason(action: &Action) -> String {
        match action {
            Action::HaltJob { reason, .. } => reason.to_string(),
            other => panic!("not a halt: {other:?}"),
        }
    }

    #[test]
    fn a_request_naming_a_reservation_goes_only_to_its_gpus_in_its_window() {
        let mut site = reserved_site(vec![], (200, 300));
        site.nodes[0].gpus.push(t4(2));
        site.pending = vec![session(1, one()), session(2, one())];
        site.policy.sessions.insert(
            session_id(1),
            Access {
                reservation: Some("school".to_owned()),
                ..access("cms")
            },
        );
        // Session 2 (no group's reservation) keeps off GPU 1 in the window and takes GPU 2;
        // session 1 takes the reserved GPU 1 only.
        site.policy.sessions.insert(session_id(2), access("atlas"));
        assert_eq!(
            plan(&site, at(200)),
            [place(1, "n1", &[1]), place(2, "n1", &[2])]
        );
        // Before the window, session 1 waits; session 2 (no max lifetime) still keeps off GPU 1.
        assert_eq!(plan(&site, at(199)), [place(2, "n1", &[2])]);
    }
}
