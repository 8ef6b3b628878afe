//! Property tests of `plan` and `check_satisfiable` on random sites.
//!
//! `reference_plan` below is a naive planner written straight from the rules in the crate
//! documentation: for every session it looks at every GPU of every node. The fast planner must
//! give exactly its plan. Independently of any reference, every plan is checked for the
//! invariants: nothing over-allocated, every requirement met, the same plan for any input
//! order, least capable GPUs first, first come first served among equal requests, and a session
//! left waiting only when no room for it remains. Sites carry batch jobs too (running, halting,
//! queued, with min/max durations, notBefore/notAfter and buckets) and sessions waiting for
//! jobs to halt; for those the invariants are: sessions and jobs together never over-allocate,
//! no GPU being halted is handed out, no job within its min duration is halted for a session,
//! no job starts before its notBefore or past its bucket's limit, and the reference planner
//! (which implements the halting rules of `batch.rs` naively, node by node, GPU by GPU) agrees.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use chrono::{DateTime, TimeZone, Utc};
use ongrid_core::job::{Bucket, BucketName, JobReason};
use ongrid_core::{
    ComputeCapability, GpuMode, GpuRequest, GpuUuid, HumanDuration, JobId, MemorySize, NodeName,
    SessionId, Sharing, UserName,
};
use ongrid_scheduler::{
    check_satisfiable, plan, Action, GpuSlot, HaltWait, NodeState, PendingSession, Priority,
    QueuedJob, RunningJob, SiteState,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

// ---------------------------------------------------------------------------------------------
// The reference planner.

/// The documented order of GPU classes: capability, memory, then a share before a whole GPU
/// (more ways first).
fn class_key(slot: &GpuSlot) -> (ComputeCapability, MemorySize, u8, u32) {
    match slot.mode {
        GpuMode::Shared { max_sessions } => {
            (slot.capability, slot.memory, 0, u32::MAX - max_sessions)
        }
        GpuMode::Exclusive => (slot.capability, slot.memory, 1, 0),
        GpuMode::Mig { .. } => (slot.capability, slot.memory, 2, 0),
    }
}

fn fits(request: &GpuRequest, slot: &GpuSlot) -> bool {
    request.fits(slot.capability, slot.memory, slot.mode)
}

fn queue_order(site: &SiteState) -> Vec<&PendingSession> {
    let mut queue: Vec<_> = site.pending.iter().collect();
    queue.sort_by_key(|session| (session.priority, session.queued_at, session.id));
    queue
}

/// Free places per GPU of online nodes, healthy GPUs only.
fn free_places(site: &SiteState) -> HashMap<GpuUuid, u32> {
    site.nodes
        .iter()
        .filter(|node| node.online)
        .flat_map(|node| &node.gpus)
        .filter(|slot| slot.healthy)
        .map(|slot| (slot.uuid.clone(), slot.free_places()))
        .collect()
}

/// The node's `count` least fitting GPUs with a free place (by class, fewest free places, UUID).
fn least_on_node<'a>(
    node: &'a NodeState,
    request: &GpuRequest,
    free: &HashMap<GpuUuid, u32>,
) -> Option<Vec<&'a GpuSlot>> {
    if !node.online {
        return None;
    }
    let mut fitting: Vec<&GpuSlot> = node
        .gpus
        .iter()
        .filter(|slot| free.get(&slot.uuid).copied().unwrap_or(0) > 0 && fits(request, slot))
        .collect();
    fitting.sort_by_key(|slot| (class_key(slot), free[&slot.uuid], slot.uuid.clone()));
    let count = request.count as usize;
    (fitting.len() >= count).then(|| fitting[..count].to_vec())
}

/// Where one request goes: `exactly` these GPUs when they are all free and fit, else the
/// pinned node, else the preferred node, else the best of all nodes.
fn reference_choose<'a>(
    site: &'a SiteState,
    free: &HashMap<GpuUuid, u32>,
    request: &GpuRequest,
    preferred: Option<&NodeName>,
    pinned: Option<&NodeName>,
    exactly: Option<(&NodeName, &[GpuUuid])>,
) -> Option<(&'a NodeState, Vec<&'a GpuSlot>)> {
    let named = |name: &NodeName| site.nodes.iter().find(|node| &node.name == name);
    if let Some((name, wanted)) = exactly {
        if let Some(node) = named(name).filter(|node| node.online) {
            let gpus: Option<Vec<&GpuSlot>> = wanted
                .iter()
                .map(|uuid| {
                    node.gpus.iter().find(|slot| {
                        &slot.uuid == uuid
                            && free.get(uuid).copied().unwrap_or(0) > 0
                            && fits(request, slot)
                    })
                })
                .collect();
            let distinct = wanted.iter().collect::<BTreeSet<_>>().len() == wanted.len();
            if let Some(gpus) = gpus {
                let allowed = pinned.is_none_or(|pinned| pinned == name);
                if allowed && distinct && !gpus.is_empty() && gpus.len() == request.count as usize {
                    return Some((node, gpus));
                }
            }
        }
    }
    if let Some(pinned) = pinned {
        let node = named(pinned)?;
        return Some((node, least_on_node(node, request, free)?));
    }
    let preferred = preferred
        .and_then(named)
        .and_then(|node| Some((node, least_on_node(node, request, free)?)));
    preferred.or_else(|| {
        let options = site
            .nodes
            .iter()
            .filter_map(|node| Some((node, least_on_node(node, request, free)?)));
        if request.count == 1 {
            options.min_by_key(|(node, gpus)| {
                let gpu = gpus[0];
                (
                    class_key(gpu),
                    free[&gpu.uuid],
                    node.name.clone(),
                    gpu.uuid.clone(),
                )
            })
        } else {
            options.min_by_key(|(node, gpus)| {
                let top_down: Vec<_> = gpus.iter().rev().map(|gpu| class_key(gpu)).collect();
                (top_down, node.name.clone())
            })
        }
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobStatus {
    Running,
    Halting,
    Claimed,
}

/// `started + duration <= now`.
fn reached(started: DateTime<Utc>, duration: HumanDuration, now: DateTime<Utc>) -> bool {
    started + chrono::Duration::seconds(duration.as_duration().as_secs() as i64) <= now
}

/// The running job's GPUs the planner counts: healthy GPUs of its node, which is online.
fn job_gpus<'a>(site: &'a SiteState, job: &RunningJob) -> Vec<&'a GpuSlot> {
    site.nodes
        .iter()
        .filter(|node| node.online && node.name == job.node)
        .flat_map(|node| &node.gpus)
        .filter(|slot| slot.healthy && job.gpus.contains(&slot.uuid))
        .collect()
}

/// A node, the session's GPUs there, the jobs to halt and the jobs to wait for.
type ReferencePreemption<'a> = (&'a NodeState, Vec<&'a GpuSlot>, Vec<JobId>, Vec<JobId>);

/// The halting rules of `batch.rs`, node by node: (node, session's GPUs, jobs to halt, jobs
/// to wait for).
fn reference_preempt<'a>(
    site: &'a SiteState,
    free: &HashMap<GpuUuid, u32>,
    status: &BTreeMap<JobId, JobStatus>,
    request: &GpuRequest,
    pinned: Option<&NodeName>,
    now: DateTime<Utc>,
) -> Option<ReferencePreemption<'a>> {
    let count = request.count as usize;
    let eligible = |job: &RunningJob| {
        status.get(&job.id) == Some(&JobStatus::Running)
            && job
                .min_duration
                .is_none_or(|min| reached(job.started_at, min, now))
    };
    let mut best = None;
    let mut best_key = None;
    for node in site.nodes.iter().filter(|node| node.online) {
        if pinned.is_some_and(|pinned| pinned != &node.name) {
            continue;
        }
        let mut jobs: Vec<&RunningJob> = site
            .running_jobs
            .iter()
            .filter(|job| job.node == node.name && status.contains_key(&job.id))
            .collect();
        jobs.sort_by_key(|job| job.id);
        if !jobs
            .iter()
            .any(|job| eligible(job) || status[&job.id] == JobStatus::Halting)
        {
            continue;
        }
        let holders = |slot: &GpuSlot| -> Vec<&RunningJob> {
            jobs.iter()
                .copied()
                .filter(|job| job_gpus(site, job).iter().any(|g| g.uuid == slot.uuid))
                .collect()
        };
        let mut gpus: Vec<&GpuSlot> = Vec::new();
        let mut waiting: Vec<(&GpuSlot, JobId)> = Vec::new();
        let mut haltable: Vec<&GpuSlot> = Vec::new();
        for slot in node.gpus.iter().filter(|s| s.healthy && fits(request, s)) {
            if free[&slot.uuid] > 0 {
                gpus.push(slot);
            } else if let Some(job) = holders(slot)
                .iter()
                .find(|job| status[&job.id] == JobStatus::Halting)
            {
                waiting.push((slot, job.id));
            } else if holders(slot).iter().any(|job| eligible(job)) {
                haltable.push(slot);
            }
        }
        if gpus.len() >= count || gpus.len() + waiting.len() + haltable.len() < count {
            continue;
        }
        let mut need = count - gpus.len();
        waiting.sort_by_key(|(slot, _)| (class_key(slot), slot.uuid.clone()));
        let mut claims: Vec<JobId> = Vec::new();
        for (slot, job) in waiting.iter().take(need) {
            gpus.push(slot);
            claims.push(*job);
        }
        need -= waiting.len().min(need);
        let mut halts: Vec<&RunningJob> = Vec::new();
        let mut covered: Vec<&GpuSlot> = Vec::new();
        while covered.len() < need {
            let missing = need - covered.len();
            let options: Vec<(&RunningJob, usize)> = jobs
                .iter()
                .copied()
                .filter(|job| eligible(job) && !halts.iter().any(|h| h.id == job.id))
                .map(|job| {
                    let frees = haltable
                        .iter()
                        .filter(|slot| !covered.iter().any(|c| c.uuid == slot.uuid))
                        .filter(|slot| job.gpus.contains(&slot.uuid))
                        .count();
                    (job, frees)
                })
                .filter(|(_, frees)| *frees > 0)
                .collect();
            let least = |job: &RunningJob| {
                haltable
                    .iter()
                    .filter(|slot| !covered.iter().any(|c| c.uuid == slot.uuid))
                    .filter(|slot| job.gpus.contains(&slot.uuid))
                    .map(|slot| (class_key(slot), slot.uuid.clone()))
                    .min()
            };
            let choice = options
                .iter()
                .filter(|(_, frees)| *frees >= missing)
                .min_by_key(|(job, _)| (job.gpus.len(), least(job), job.id))
                .or_else(|| {
                    options.iter().min_by_key(|(job, frees)| {
                        (std::cmp::Reverse(*frees), job.gpus.len(), job.id)
                    })
                });
            let Some((job, _)) = choice else { break };
            for slot in &haltable {
                if job.gpus.contains(&slot.uuid) && !covered.iter().any(|c| c.uuid == slot.uuid) {
                    covered.push(slot);
                }
            }
            halts.push(job);
        }
        if covered.len() < need {
            continue;
        }
        covered.sort_by_key(|slot| (class_key(slot), slot.uuid.clone()));
        gpus.extend_from_slice(&covered[..need]);
        gpus.sort_by_key(|slot| (class_key(slot), slot.uuid.clone()));
        claims.sort();
        claims.dedup();
        let mut halt_ids: Vec<JobId> = halts.iter().map(|job| job.id).collect();
        halt_ids.sort();
        let mut top_down: Vec<_> = gpus.iter().map(|slot| class_key(slot)).collect();
        top_down.sort_by(|a, b| b.cmp(a));
        let halted_gpus: usize = halts.iter().map(|job| job.gpus.len()).sum();
        let key = (halt_ids.len(), halted_gpus, top_down, node.name.clone());
        if best_key.as_ref().is_none_or(|best| &key < best) {
            let mut wait_for: Vec<JobId> = halt_ids.iter().chain(&claims).copied().collect();
            wait_for.sort();
            best = Some((node, gpus, halt_ids, wait_for));
            best_key = Some(key);
        }
    }
    best
}

fn reference_plan(site: &SiteState, now: DateTime<Utc>) -> Vec<Action> {
    let mut free = free_places(site);
    let mut actions = Vec::new();
    let online = |name: &NodeName| site.nodes.iter().any(|n| n.online && &n.name == name);

    let mut status: BTreeMap<JobId, JobStatus> = BTreeMap::new();
    let mut running: Vec<&RunningJob> = site.running_jobs.iter().collect();
    running.sort_by_key(|job| job.id);
    for job in &running {
        if online(&job.node) {
            let initial = if job.halting {
                JobStatus::Halting
            } else {
                JobStatus::Running
            };
            status.insert(job.id, initial);
        }
    }
    for job in &running {
        if let Some(max) = job.max_duration {
            if !job.halting && reached(job.started_at, max, now) {
                if let Some(s) = status.get_mut(&job.id) {
                    *s = JobStatus::Halting;
                }
                actions.push(Action::HaltJob {
                    job: job.id,
                    reason: JobReason::MaxDurationReached { max },
                });
            }
        }
    }

    let queue = queue_order(site);
    let running_ids: BTreeSet<JobId> = running.iter().map(|job| job.id).collect();
    let mut waiting: BTreeSet<SessionId> = BTreeSet::new();
    for session in &queue {
        let Some(wait) = &session.awaiting_halt else {
            continue;
        };
        if !online(&wait.node) || !wait.jobs.iter().any(|job| running_ids.contains(job)) {
            continue;
        }
        for job in &wait.jobs {
            if let Some(s) = status.get_mut(job) {
                *s = JobStatus::Claimed;
            }
        }
        let node = site
            .nodes
            .iter()
            .find(|n| n.name == wait.node)
            .expect("online");
        for uuid in &wait.gpus {
            if node
                .gpus
                .iter()
                .any(|slot| &slot.uuid == uuid && slot.healthy)
            {
                if let Some(places) = free.get_mut(uuid).filter(|places| **places > 0) {
                    *places -= 1;
                }
            }
        }
        waiting.insert(session.id);
    }

    for session in queue {
        let request = &session.request;
        if request.validate().is_err() || waiting.contains(&session.id) {
            continue;
        }
        let exactly = match (&session.pinned_node, &session.awaiting_halt) {
            (_, Some(wait)) => Some((&wait.node, wait.gpus.as_slice())),
            (Some(pinned), None) => Some((pinned, session.previous_gpus.as_slice())),
            (None, None) => None,
        };
        let chosen = reference_choose(
            site,
            &free,
            request,
            session.preferred_node.as_ref(),
            session.pinned_node.as_ref(),
            exactly,
        );
        if let Some((node, gpus)) = chosen {
            for gpu in &gpus {
                *free.get_mut(&gpu.uuid).expect("a chosen GPU is free") -= 1;
            }
            actions.push(Action::Place {
                session: session.id,
                node: node.name.clone(),
                gpus: gpus.iter().map(|gpu| gpu.uuid.clone()).collect(),
            });
            continue;
        }
        if session.pinned_node.as_ref().is_some_and(|p| !online(p)) {
            continue;
        }
        let preemption = reference_preempt(
            site,
            &free,
            &status,
            request,
            session.pinned_node.as_ref(),
            now,
        );
        if let Some((node, gpus, halts, wait_for)) = preemption {
            for gpu in &gpus {
                if let Some(places) = free.get_mut(&gpu.uuid).filter(|places| **places > 0) {
                    *places -= 1;
                }
            }
            for job in &wait_for {
                status.insert(*job, JobStatus::Claimed);
            }
            for job in &halts {
                actions.push(Action::HaltJob {
                    job: *job,
                    reason: JobReason::ForInteractiveSession { need: *request },
                });
            }
            actions.push(Action::PlaceAfterHalt {
                session: session.id,
                node: node.name.clone(),
                gpus: gpus.iter().map(|gpu| gpu.uuid.clone()).collect(),
                jobs: wait_for,
            });
        }
    }

    let mut in_bucket: HashMap<(UserName, BucketName), u32> = HashMap::new();
    for job in &site.running_jobs {
        if let Some(bucket) = &job.bucket {
            *in_bucket
                .entry((job.owner.clone(), bucket.clone()))
                .or_default() += 1;
        }
    }
    let mut jobs: Vec<&QueuedJob> = site.queued_jobs.iter().collect();
    jobs.sort_by_key(|job| (job.priority, job.queued_at, job.id));
    for job in jobs {
        if let Some(not_after) = job.not_after.filter(|&t| t <= now) {
            actions.push(Action::CancelJob {
                job: job.id,
                reason: JobReason::NotStartedByNotAfter { not_after },
            });
            continue;
        }
        if job.not_before.is_some_and(|t| t > now) || job.request.validate().is_err() {
            continue;
        }
        let key = job
            .bucket
            .as_ref()
            .map(|b| ((job.owner.clone(), b.name.clone()), b.max));
        if let Some((key, max)) = &key {
            if in_bucket.get(key).copied().unwrap_or(0) >= *max {
                continue;
            }
        }
        let chosen = reference_choose(
            site,
            &free,
            &job.request,
            None,
            job.pinned_node.as_ref(),
            None,
        );
        if let Some((node, gpus)) = chosen {
            for gpu in &gpus {
                *free.get_mut(&gpu.uuid).expect("a chosen GPU is free") -= 1;
            }
            if let Some((key, _)) = key {
                *in_bucket.entry(key).or_default() += 1;
            }
            actions.push(Action::StartJob {
                job: job.id,
                node: node.name.clone(),
                gpus: gpus.iter().map(|gpu| gpu.uuid.clone()).collect(),
            });
        }
    }
    actions
}

// ---------------------------------------------------------------------------------------------
// Invariants any plan must keep.

fn placements(actions: &[Action]) -> BTreeMap<SessionId, (&NodeName, &[GpuUuid])> {
    actions
        .iter()
        .filter_map(|action| match action {
            Action::Place {
                session,
                node,
                gpus,
            } => Some((*session, (node, gpus.as_slice()))),
            _ => None,
        })
        .collect()
}

fn check_invariants(site: &SiteState, actions: &[Action]) -> Result<(), TestCaseError> {
    let sessions: HashMap<SessionId, &PendingSession> =
        site.pending.iter().map(|s| (s.id, s)).collect();
    let slots: HashMap<&GpuUuid, (&NodeState, &GpuSlot)> = site
        .nodes
        .iter()
        .flat_map(|node| node.gpus.iter().map(move |slot| (&slot.uuid, (node, slot))))
        .collect();
    let placed = placements(actions);
    prop_assert_eq!(placed.len(), actions.len(), "a session was placed twice");

    // Never over-allocates; offline nodes and unhealthy GPUs get nothing; requirements met.
    let mut taken: HashMap<&GpuUuid, u32> = HashMap::new();
    for (session, (node_name, gpus)) in &placed {
        let pending = sessions
            .get(session)
            .ok_or_else(|| TestCaseError::fail("placed a session that is not pending"))?;
        let request = &pending.request;
        prop_assert!(request.validate().is_ok(), "placed an invalid request");
        prop_assert_eq!(gpus.len(), request.count as usize, "wrong number of GPUs");
        prop_assert_eq!(
            gpus.iter().collect::<BTreeSet<_>>().len(),
            gpus.len(),
            "a GPU given twice to one session"
        );
        for uuid in *gpus {
            let (node, slot) = slots
                .get(uuid)
                .ok_or_else(|| TestCaseError::fail("placed on an unknown GPU"))?;
            prop_assert_eq!(&node.name, *node_name, "GPU of another node");
            if let Some(pinned) = &pending.pinned_node {
                prop_assert_eq!(pinned, *node_name, "a pinned session placed elsewhere");
            }
            prop_assert!(node.online, "placed on an offline node");
            prop_assert!(slot.healthy, "placed on an unhealthy GPU");
            prop_assert!(fits(request, slot), "requirement violated");
            *taken.entry(uuid).or_default() += 1;
        }
        prop_assert!(
            check_satisfiable(site, request).is_ok(),
            "placed a session the site can never satisfy"
        );
    }
    let mut free_at_end = free_places(site);
    for (uuid, count) in &taken {
        let free = free_at_end
            .get_mut(*uuid)
            .ok_or_else(|| TestCaseError::fail("placed on a GPU with no place"))?;
        prop_assert!(*count <= *free, "{} over-allocated", uuid);
        *free -= count;
    }

    // A session stays unplaced only when no room for it remains at the end.
    for session in &site.pending {
        if placed.contains_key(&session.id) || session.request.validate().is_err() {
            continue;
        }
        let room = site
            .nodes
            .iter()
            .filter(|node| {
                session
                    .pinned_node
                    .as_ref()
                    .is_none_or(|pinned| &node.name == pinned)
            })
            .find(|node| least_on_node(node, &session.request, &free_at_end).is_some());
        prop_assert!(
            room.is_none(),
            "session {} left waiting though {} has room",
            session.id,
            room.map(|node| node.name.as_str()).unwrap_or_default()
        );
    }

    // Least capable first: no one-GPU session (without a preference) left a strictly less
    // capable fitting GPU free.
    for (session, (_, gpus)) in &placed {
        let pending = sessions[session];
        if pending.request.count != 1
            || pending.preferred_node.is_some()
            || pending.pinned_node.is_some()
        {
            continue;
        }
        let given = class_key(slots[&gpus[0]].1);
        let better = slots.values().find(|(node, slot)| {
            node.online
                && free_at_end.get(&slot.uuid).copied().unwrap_or(0) > 0
                && fits(&pending.request, slot)
                && class_key(slot) < given
        });
        prop_assert!(
            better.is_none(),
            "session {} got a GPU of class {:?} while {:?} stayed free",
            session,
            given,
            better.map(|(_, slot)| &slot.uuid)
        );
    }

    // First come, first served among equal requests.
    let queue = queue_order(site);
    for (i, earlier) in queue.iter().enumerate() {
        for later in &queue[i + 1..] {
            if earlier.request == later.request
                && earlier.pinned_node == later.pinned_node
                && placed.contains_key(&later.id)
            {
                prop_assert!(
                    placed.contains_key(&earlier.id),
                    "session {} placed before the earlier equal {}",
                    later.id,
                    earlier.id
                );
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Random sites.

const CLASSES: [(&str, &str); 5] = [
    ("7.5", "16G"),
    ("8.0", "40G"),
    ("8.0", "80G"),
    ("9.0", "80G"),
    ("8.6", "24G"),
];
const MODES: [GpuMode; 4] = [
    GpuMode::Exclusive,
    GpuMode::Exclusive,
    GpuMode::Shared { max_sessions: 2 },
    GpuMode::Shared { max_sessions: 4 },
];

#[derive(Debug, Clone)]
struct GpuSpec {
    class: usize,
    mode: usize,
    healthy: bool,
    used: u32,
}

#[derive(Debug, Clone)]
struct SessionSpec {
    count: u32,
    min_capability: Option<&'static str>,
    min_memory: Option<&'static str>,
    sharing: Sharing,
    queued: i64,
    preferred: Option<usize>,
    pinned: Option<usize>,
}

fn gpu_spec() -> impl Strategy<Value = GpuSpec> {
    (
        0..CLASSES.len(),
        0..MODES.len(),
        prop::bool::weighted(0.9),
        prop_oneof![3 => Just(0u32), 1 => 0u32..=5],
    )
        .prop_map(|(class, mode, healthy, used)| GpuSpec {
            class,
            mode,
            healthy,
            used,
        })
}

fn session_spec(nodes: usize) -> impl Strategy<Value = SessionSpec> {
    (
        prop_oneof![12 => Just(1u32), 4 => Just(2), 2 => Just(3), 2 => Just(4), 1 => Just(0)],
        prop::option::of(prop::sample::select(vec![
            "7.5", "8.0", "8.6", "9.0", "9.5",
        ])),
        prop::option::of(prop::sample::select(vec![
            "16G", "24G", "40G", "80G", "100G",
        ])),
        prop::sample::select(vec![Sharing::Exclusive, Sharing::Shared, Sharing::Any]),
        0i64..6,
        prop::option::weighted(0.2, 0..nodes + 1),
        prop::option::weighted(0.15, 0..nodes + 1),
    )
        .prop_map(
            |(count, min_capability, min_memory, sharing, queued, preferred, pinned)| SessionSpec {
                count,
                min_capability,
                min_memory,
                sharing,
                queued,
                preferred,
                pinned,
            },
        )
}

fn gpu_uuid(n: usize) -> GpuUuid {
    GpuUuid::parse(&format!("GPU-{n:08x}-1111-2222-3333-444444444444")).expect("valid UUID")
}

fn node_name(n: usize) -> NodeName {
    NodeName::parse(&format!("node{n}")).expect("valid node name")
}

fn at(second: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_750_000_000 + second, 0)
        .single()
        .expect("valid time")
}

fn build_site(nodes: Vec<(bool, Vec<GpuSpec>)>, sessions: Vec<SessionSpec>) -> SiteState {
    let node_count = nodes.len();
    let mut gpu_number: usize = 0;
    let nodes = nodes
        .into_iter()
        .enumerate()
        .map(|(n, (online, gpus))| NodeState {
            // Names sort differently from the generated order ("node10" < "node9").
            name: node_name(n),
            online,
            drained: false,
            gpus: gpus
                .into_iter()
                .map(|spec| {
                    gpu_number += 1;
                    let (capability, memory) = CLASSES[spec.class];
                    GpuSlot {
                        // UUIDs sort differently from the generated order, too.
                        uuid: gpu_uuid(gpu_number.wrapping_mul(2_654_435_761) % (1 << 32)),
                        capability: capability.parse().expect("valid capability"),
                        memory: memory.parse().expect("valid memory"),
                        mode: MODES[spec.mode],
                        healthy: spec.healthy,
                        drained: false,
                        used: spec.used,
                    }
                })
                .collect(),
        })
        .collect();
    let pending = sessions
        .into_iter()
        .enumerate()
        .map(|(n, spec)| PendingSession {
            // Ids sort differently from the queue order.
            id: format!(
                "{:032x}",
                (n as u128 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            )
            .parse()
            .expect("valid session id"),
            request: GpuRequest {
                count: spec.count,
                min_capability: spec.min_capability.map(|c| c.parse().expect("valid")),
                min_memory: spec.min_memory.map(|m| m.parse().expect("valid")),
                sharing: spec.sharing,
            },
            queued_at: at(spec.queued),
            // One past the last node is a node the site does not know.
            preferred_node: spec.preferred.map(|n| node_name(n.min(node_count))),
            pinned_node: spec.pinned.map(|n| node_name(n.min(node_count))),
            previous_gpus: Vec::new(),
            awaiting_halt: None,
            priority: Default::default(),
        })
        .collect();
    SiteState {
        nodes,
        pending,
        ..SiteState::default()
    }
}

fn site_strategy(
    max_nodes: usize,
    max_gpus: usize,
    max_pending: usize,
) -> impl Strategy<Value = SiteState> {
    (1..=max_nodes).prop_flat_map(move |nodes| {
        (
            prop::collection::vec(
                (
                    prop::bool::weighted(0.9),
                    prop::collection::vec(gpu_spec(), 0..=max_gpus),
                ),
                nodes,
            ),
            prop::collection::vec(session_spec(nodes), 0..=max_pending),
        )
            .prop_map(|(nodes, sessions)| build_site(nodes, sessions))
    })
}

/// SplitMix64, for the batch jobs derived from a seed.
struct Random(u64);

impl Random {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn job_id(n: u64) -> JobId {
    // Ids sort differently from the generated order.
    format!(
        "{:032x}",
        u128::from(n + 1).wrapping_mul(0x2545_f491_4f6c_dd1d)
    )
    .parse()
    .expect("valid job id")
}

/// Adds batch work to a site: running jobs on 1 or 2 GPUs of a node (counted in `used`), some
/// halting, some within their min duration or past their max duration at second 100; queued
/// jobs with notBefore/notAfter, buckets and pins; and sessions waiting for jobs to halt.
fn with_jobs(mut site: SiteState, seed: u64) -> SiteState {
    let mut random = Random(seed);
    let owners = [
        UserName::parse("alice").expect("valid"),
        UserName::parse("bob").expect("valid"),
    ];
    let buckets = ["b1", "b2"];
    let mut next_job = 0u64;
    let node_count = site.nodes.len();
    for node in &mut site.nodes {
        let mut g = 0;
        while g < node.gpus.len() {
            if !random.chance(45) {
                g += 1;
                continue;
            }
            let width = if random.chance(25) { 2 } else { 1 }.min(node.gpus.len() - g);
            let gpus: Vec<GpuUuid> = node.gpus[g..g + width]
                .iter()
                .map(|slot| slot.uuid.clone())
                .collect();
            for slot in &mut node.gpus[g..g + width] {
                slot.used += 1;
            }
            next_job += 1;
            site.running_jobs.push(RunningJob {
                id: job_id(next_job),
                owner: owners[random.below(2) as usize].clone(),
                node: node.name.clone(),
                gpus,
                started_at: at(random.below(100) as i64),
                max_duration: random
                    .chance(25)
                    .then(|| HumanDuration::from_secs(50 + random.below(150))),
                min_duration: random
                    .chance(80)
                    .then(|| HumanDuration::from_secs(random.below(120))),
                bucket: random
                    .chance(40)
                    .then(|| BucketName::parse(buckets[random.below(2) as usize]).expect("valid")),
                halting: random.chance(15),
            });
            // Shared GPUs may hold a second job.
            if !random.chance(30) {
                g += width;
            }
        }
    }
    let queued = random.below(10);
    for _ in 0..queued {
        next_job += 1;
        let request = GpuRequest {
            count: [1, 1, 1, 2, 3, 0][random.below(6) as usize],
            min_capability: [None, Some("8.0"), Some("9.0")][random.below(3) as usize]
                .map(|c| c.parse().expect("valid")),
            min_memory: [None, None, Some("40G")][random.below(3) as usize]
                .map(|m| m.parse().expect("valid")),
            sharing: [Sharing::Exclusive, Sharing::Shared, Sharing::Any][random.below(3) as usize],
        };
        site.queued_jobs.push(QueuedJob {
            id: job_id(next_job),
            owner: owners[random.below(2) as usize].clone(),
            request,
            queued_at: at(random.below(6) as i64),
            not_before: random.chance(20).then(|| at(50 + random.below(100) as i64)),
            not_after: random.chance(20).then(|| at(50 + random.below(100) as i64)),
            bucket: random.chance(40).then(|| {
                Bucket::parse(&format!(
                    "{}:{}",
                    buckets[random.below(2) as usize],
                    1 + random.below(2)
                ))
                .expect("valid")
            }),
            pinned_node: random
                .chance(10)
                .then(|| node_name(random.below(node_count as u64 + 1) as usize)),
            priority: Default::default(),
        });
    }
    let running: Vec<(NodeName, Vec<GpuUuid>, JobId)> = site
        .running_jobs
        .iter()
        .map(|job| (job.node.clone(), job.gpus.clone(), job.id))
        .collect();
    for session in &mut site.pending {
        if running.is_empty() || !random.chance(15) {
            continue;
        }
        let (node, gpus, job) = &running[random.below(running.len() as u64) as usize];
        let unknown = job_id(10_000 + random.below(5));
        session.awaiting_halt = Some(HaltWait {
            node: node.clone(),
            gpus: gpus.clone(),
            jobs: vec![if random.chance(70) { *job } else { unknown }],
        });
    }
    site
}

/// What any plan with batch jobs must keep, independently of the reference.
fn check_job_invariants(
    site: &SiteState,
    actions: &[Action],
    now: DateTime<Utc>,
) -> Result<(), TestCaseError> {
    let free = free_places(site);
    let running: HashMap<JobId, &RunningJob> =
        site.running_jobs.iter().map(|job| (job.id, job)).collect();
    let queued: HashMap<JobId, &QueuedJob> =
        site.queued_jobs.iter().map(|job| (job.id, job)).collect();
    let mut given: HashMap<&GpuUuid, u32> = HashMap::new();
    let mut halted: BTreeSet<JobId> = BTreeSet::new();
    let mut in_bucket: HashMap<(UserName, BucketName), u32> = HashMap::new();
    for job in &site.running_jobs {
        if let Some(bucket) = &job.bucket {
            *in_bucket
                .entry((job.owner.clone(), bucket.clone()))
                .or_default() += 1;
        }
    }
    for action in actions {
        match action {
            Action::Place { gpus, .. } => {
                for gpu in gpus {
                    *given.entry(gpu).or_default() += 1;
                }
            }
            Action::StartJob { job, gpus, node } => {
                let job = queued
                    .get(job)
                    .ok_or_else(|| TestCaseError::fail("started a job that is not queued"))?;
                prop_assert!(
                    job.pinned_node.as_ref().is_none_or(|pinned| pinned == node),
                    "a pinned job started on another node"
                );
                prop_assert!(
                    job.not_before.is_none_or(|t| t <= now),
                    "started before notBefore"
                );
                prop_assert!(
                    job.not_after.is_none_or(|t| t > now),
                    "started after notAfter"
                );
                prop_assert_eq!(gpus.len(), job.request.count as usize);
                if let Some(bucket) = &job.bucket {
                    let count = in_bucket
                        .entry((job.owner.clone(), bucket.name.clone()))
                        .or_default();
                    *count += 1;
                    prop_assert!(*count <= bucket.max, "bucket {} over its limit", bucket);
                }
                for gpu in gpus {
                    *given.entry(gpu).or_default() += 1;
                }
            }
            Action::HaltJob { job, reason } => {
                let running = running
                    .get(job)
                    .ok_or_else(|| TestCaseError::fail("halted a job that does not run"))?;
                prop_assert!(!running.halting, "halted a job that is halting already");
                prop_assert!(halted.insert(*job), "halted twice");
                match reason {
                    JobReason::ForInteractiveSession { .. } => prop_assert!(
                        running.min_duration.is_none_or(|min| reached(
                            running.started_at,
                            min,
                            now
                        )),
                        "job {} halted within its min duration",
                        job
                    ),
                    JobReason::MaxDurationReached { max } => {
                        prop_assert_eq!(Some(*max), running.max_duration);
                        prop_assert!(reached(running.started_at, *max, now));
                    }
                    other => prop_assert!(false, "unexpected halt reason {:?}", other),
                }
            }
            Action::PlaceAfterHalt { gpus, jobs, .. } => {
                for gpu in gpus {
                    let freed = jobs
                        .iter()
                        .any(|job| running.get(job).is_some_and(|j| j.gpus.contains(gpu)));
                    prop_assert!(
                        freed || free.get(gpu).copied().unwrap_or(0) > 0,
                        "waits for {} that none of its jobs frees",
                        gpu
                    );
                }
                for job in jobs {
                    let job = running
                        .get(job)
                        .ok_or_else(|| TestCaseError::fail("waits for a job that does not run"))?;
                    prop_assert!(
                        job.halting || halted.contains(&job.id),
                        "waits for a running job"
                    );
                }
            }
            Action::CancelJob { job, .. } => {
                let job = queued
                    .get(job)
                    .ok_or_else(|| TestCaseError::fail("cancelled a job that is not queued"))?;
                prop_assert!(job.not_after.is_some_and(|t| t <= now));
            }
        }
    }
    for (gpu, count) in given {
        prop_assert!(
            count <= free.get(gpu).copied().unwrap_or(0),
            "{} over-allocated by sessions and jobs together",
            gpu
        );
    }
    Ok(())
}

/// Shuffles the nodes, each node's GPUs and the queue (Fisher-Yates with xorshift).
fn shuffled(site: &SiteState, seed: u64) -> SiteState {
    let mut state = seed | 1;
    let mut next = move |below: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % below as u64) as usize
    };
    let mut shuffle = |len: usize| -> Vec<usize> {
        let mut order: Vec<usize> = (0..len).collect();
        for i in (1..len).rev() {
            order.swap(i, next(i + 1));
        }
        order
    };
    let mut site = site.clone();
    let order = shuffle(site.nodes.len());
    site.nodes = order.iter().map(|&i| site.nodes[i].clone()).collect();
    for node in &mut site.nodes {
        let order = shuffle(node.gpus.len());
        node.gpus = order.iter().map(|&i| node.gpus[i].clone()).collect();
    }
    let order = shuffle(site.pending.len());
    site.pending = order.iter().map(|&i| site.pending[i].clone()).collect();
    let order = shuffle(site.queued_jobs.len());
    site.queued_jobs = order.iter().map(|&i| site.queued_jobs[i].clone()).collect();
    let order = shuffle(site.running_jobs.len());
    site.running_jobs = order
        .iter()
        .map(|&i| site.running_jobs[i].clone())
        .collect();
    site
}

/// The site with fair-share priorities drawn from `seed`: few distinct values, so ties (decided
/// by `queued_at`) are common too.
fn with_priorities(mut site: SiteState, seed: u64) -> SiteState {
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        Priority {
            group: state % 3,
            user: (state >> 8) % 3,
        }
    };
    for session in &mut site.pending {
        session.priority = next();
    }
    for job in &mut site.queued_jobs {
        job.priority = next();
    }
    site
}

// ---------------------------------------------------------------------------------------------
// The properties.

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn small_sites(site in site_strategy(5, 6, 24), seed in any::<u64>()) {
        let actions = plan(&site, at(100));
        check_invariants(&site, &actions)?;
        prop_assert_eq!(&actions, &reference_plan(&site, at(100)));
        prop_assert_eq!(&actions, &plan(&shuffled(&site, seed), at(100)));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Sessions and jobs in one plan: the reference agrees, the invariants hold, the order of
    /// the input does not matter.
    #[test]
    fn sites_with_jobs(site in site_strategy(6, 6, 20), jobs in any::<u64>(), seed in any::<u64>()) {
        let site = with_jobs(site, jobs);
        let actions = plan(&site, at(100));
        check_job_invariants(&site, &actions, at(100))?;
        prop_assert_eq!(&actions, &reference_plan(&site, at(100)));
        prop_assert_eq!(&actions, &plan(&shuffled(&site, seed), at(100)));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Fair share: with priorities, the plan still agrees with the reference (which serves
    /// `(priority, queued_at, id)` in order), keeps every invariant, and ignores input order.
    #[test]
    fn sites_with_fair_share_priorities(
        site in site_strategy(6, 6, 20),
        jobs in any::<u64>(),
        priorities in any::<u64>(),
        seed in any::<u64>(),
    ) {
        let site = with_priorities(with_jobs(site, jobs), priorities);
        let actions = plan(&site, at(100));
        check_job_invariants(&site, &actions, at(100))?;
        prop_assert_eq!(&actions, &reference_plan(&site, at(100)));
        prop_assert_eq!(&actions, &plan(&shuffled(&site, seed), at(100)));
    }

    /// Fair share decides who gets scarce GPUs: of equal one-GPU requests, more than there are
    /// free GPUs, exactly those lowest in `(priority, queued_at)` order are placed, whatever
    /// order they arrived in.
    #[test]
    fn scarce_gpus_go_to_the_lowest_usage_first(
        free in 1usize..5,
        waiting in proptest::collection::vec((0u64..4, 0u64..4, 0i64..50), 1..12),
    ) {
        let gpu = |n: usize| GpuSlot {
            uuid: format!("GPU-{n:08x}-0000-0000-0000-000000000000").parse().expect("valid"),
            capability: "8.0".parse().expect("valid"),
            memory: "40G".parse().expect("valid"),
            mode: GpuMode::Exclusive,
            healthy: true,
            drained: false,
            used: 0,
        };
        let request = GpuRequest {
            count: 1,
            min_capability: None,
            min_memory: None,
            sharing: Sharing::Exclusive,
        };
        let pending: Vec<PendingSession> = waiting
            .iter()
            .enumerate()
            .map(|(n, &(group, user, queued))| PendingSession {
                id: format!("{:032x}", n + 1).parse().expect("valid"),
                request,
                queued_at: at(queued),
                preferred_node: None,
                pinned_node: None,
                previous_gpus: Vec::new(),
                awaiting_halt: None,
                priority: Priority { group, user },
            })
            .collect();
        let site = SiteState {
            nodes: vec![NodeState {
                name: node_name(1),
                online: true,
                drained: false,
                gpus: (0..free).map(gpu).collect(),
            }],
            pending: pending.clone(),
            ..SiteState::default()
        };
        let placed: HashSet<SessionId> = plan(&site, at(100))
            .iter()
            .filter_map(|action| match action {
                Action::Place { session, .. } => Some(*session),
                _ => None,
            })
            .collect();
        let mut order = pending;
        order.sort_by_key(|s| (s.priority, s.queued_at, s.id));
        let expected: HashSet<SessionId> = order.iter().take(free).map(|s| s.id).collect();
        prop_assert_eq!(placed, expected);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn larger_sites(site in site_strategy(40, 8, 300), seed in any::<u64>()) {
        let actions = plan(&site, at(100));
        check_invariants(&site, &actions)?;
        prop_assert_eq!(&actions, &reference_plan(&site, at(100)));
        prop_assert_eq!(&actions, &plan(&shuffled(&site, seed), at(100)));
    }

    /// A request the site can never meet is never placed, and one it can meet is placed on the
    /// same site when it is idle and all online.
    #[test]
    fn satisfiable_means_placeable_on_the_idle_site(
        site in site_strategy(5, 6, 0),
        spec in session_spec(1),
    ) {
        let mut idle = build_site(Vec::new(), vec![spec]);
        idle.nodes = site.nodes.clone();
        for node in &mut idle.nodes {
            node.online = true;
            for slot in &mut node.gpus {
                slot.used = 0;
            }
        }
        idle.pending[0].preferred_node = None;
        idle.pending[0].pinned_node = None;
        let placed = !plan(&idle, at(100)).is_empty();
        match check_satisfiable(&site, &idle.pending[0].request) {
            Ok(()) => prop_assert!(placed, "satisfiable but not placed on the idle site"),
            Err(error) => prop_assert!(!placed, "placed though {}", error),
        }
    }
}

/// The site as the plan must see it when drained nodes were offline and drained GPUs unhealthy.
fn drains_as_outages(site: &SiteState) -> SiteState {
    let mut out = site.clone();
    for node in &mut out.nodes {
        node.online &= !node.drained;
        node.drained = false;
        for slot in &mut node.gpus {
            slot.healthy &= !slot.drained;
            slot.drained = false;
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Drained nodes and GPUs get nothing new (no session placed or waiting for halts there,
    /// no job started there), while work running there is still halted at its max duration:
    /// the plan is exactly the one for the same site with drained nodes offline and drained
    /// GPUs unhealthy.
    #[test]
    fn drained_nodes_and_gpus_get_nothing(
        site in site_strategy(5, 6, 20),
        jobs in any::<u64>(),
        drains in any::<u64>(),
    ) {
        let mut site = with_jobs(site, jobs);
        let mut random = Random(drains);
        for node in &mut site.nodes {
            node.drained = random.chance(25);
            for slot in &mut node.gpus {
                slot.drained = random.chance(25);
            }
        }
        let drained_nodes: BTreeSet<NodeName> = site
            .nodes
            .iter()
            .filter(|n| n.drained)
            .map(|n| n.name.clone())
            .collect();
        let drained_gpus: BTreeSet<GpuUuid> = site
            .nodes
            .iter()
            .flat_map(|n| n.gpus.iter())
            .filter(|g| g.drained)
            .map(|g| g.uuid.clone())
            .collect();
        let actions = plan(&site, at(100));
        for action in &actions {
            let (node, gpus) = match action {
                Action::Place { node, gpus, .. }
                | Action::PlaceAfterHalt { node, gpus, .. }
                | Action::StartJob { node, gpus, .. } => (node, gpus),
                Action::HaltJob { .. } | Action::CancelJob { .. } => continue,
            };
            prop_assert!(!drained_nodes.contains(node), "work placed on drained node {}", node);
            for gpu in gpus {
                prop_assert!(!drained_gpus.contains(gpu), "work placed on drained GPU {}", gpu);
            }
        }
        for job in &site.running_jobs {
            let past_max = job
                .max_duration
                .is_some_and(|max| !job.halting && reached(job.started_at, max, at(100)));
            if past_max {
                prop_assert!(
                    actions.iter().any(|a| matches!(a, Action::HaltJob { job: id, .. } if *id == job.id)),
                    "job {} past its max duration not halted", job.id
                );
            }
        }
        let outages = drains_as_outages(&site);
        prop_assert_eq!(&actions, &plan(&outages, at(100)));
        check_job_invariants(&outages, &actions, at(100))?;
    }
}

/// The invariant checker must catch a broken plan, or the properties above prove nothing.
#[test]
fn the_invariant_checker_catches_broken_plans() {
    let gpu = |n: usize, capability: &str, mode: GpuMode| GpuSlot {
        uuid: gpu_uuid(n),
        capability: capability.parse().expect("valid"),
        memory: "40G".parse().expect("valid"),
        mode,
        healthy: true,
        drained: false,
        used: 0,
    };
    let request = GpuRequest {
        count: 1,
        min_capability: None,
        min_memory: None,
        sharing: Sharing::Exclusive,
    };
    let session = |n: u32| PendingSession {
        id: format!("{n:032x}").parse().expect("valid session id"),
        request,
        queued_at: at(i64::from(n)),
        preferred_node: None,
        pinned_node: None,
        previous_gpus: Vec::new(),
        awaiting_halt: None,
        priority: Default::default(),
    };
    let site_with = |pending: Vec<PendingSession>| SiteState {
        nodes: vec![NodeState {
            name: node_name(1),
            online: true,
            drained: false,
            gpus: vec![
                gpu(1, "7.5", GpuMode::Exclusive),
                gpu(2, "9.0", GpuMode::Exclusive),
                gpu(3, "8.0", GpuMode::Shared { max_sessions: 2 }),
            ],
        }],
        pending,
        ..SiteState::default()
    };
    let site = site_with(vec![session(1), session(2), session(3)]);
    let alone = site_with(vec![session(1)]);
    let place = |session: u32, gpu: usize| Action::Place {
        session: format!("{session:032x}").parse().expect("valid session id"),
        node: node_name(1),
        gpus: vec![gpu_uuid(gpu)],
    };
    let good = vec![place(1, 1), place(2, 2)];
    assert!(check_invariants(&site, &good).is_ok());
    assert_eq!(reference_plan(&site, at(100)), good);
    let broken = [
        (&site, vec![place(1, 1), place(2, 1)]), // over-allocated
        (&site, vec![place(1, 3)]),              // exclusive request on a shared GPU
        (&alone, vec![place(1, 2)]),             // a less capable GPU stayed free
        (&site, vec![place(1, 1)]),              // session 2 waits though the 9.0 is free
        (&site, vec![place(2, 1), place(3, 2)]), // the later of equal requests won
        (&site, vec![place(1, 1), place(1, 2)]), // placed twice
    ];
    for (site, plan) in broken {
        assert!(check_invariants(site, &plan).is_err(), "{plan:?} passed");
    }
}

/// The random job sites do reach every rule, or `sites_with_jobs` would prove little.
#[test]
fn the_job_sites_reach_every_action() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for n in 0..300 {
        let site = site_strategy(6, 6, 20)
            .new_tree(&mut runner)
            .expect("a site")
            .current();
        let site = with_jobs(site, n);
        for action in plan(&site, at(100)) {
            let kind = match action {
                Action::Place { .. } => "place",
                Action::PlaceAfterHalt { ref jobs, .. } if jobs.is_empty() => "empty wait",
                Action::PlaceAfterHalt { .. } => "place after halt",
                Action::HaltJob {
                    reason: JobReason::ForInteractiveSession { .. },
                    ..
                } => "halt for a session",
                Action::HaltJob { .. } => "halt at max duration",
                Action::StartJob { .. } => "start job",
                Action::CancelJob { .. } => "cancel job",
            };
            *seen.entry(kind).or_default() += 1;
        }
    }
    eprintln!("{seen:?}");
    for kind in [
        "place",
        "place after halt",
        "halt for a session",
        "halt at max duration",
        "start job",
        "cancel job",
    ] {
        assert!(
            seen.get(kind).copied().unwrap_or(0) >= 5,
            "{kind}: {seen:?}"
        );
    }
    assert!(!seen.contains_key("empty wait"), "{seen:?}");
}
