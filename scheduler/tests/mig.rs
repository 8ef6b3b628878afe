//! Property tests of MIG placement on random sites: `plan_mig` never gives one MIG device to two
//! sessions, never a used device or one of an unusable GPU or node, always one that meets the
//! request, the least sufficient one first, and leaves a session waiting only when no free
//! device meets it; `plan` never gives a GPU in MIG mode to a whole-GPU request. With batch
//! jobs (`plan_mig_jobs`): never two users, session or job, on one device; a whole-GPU job never
//! on a GPU in MIG mode; a session halts a job only when no free device meets it, at most one,
//! past its min duration, and only when no halting job already frees one for it.
//! Under owners and reservations, no session lands on a device of a GPU reserved for another
//! group in an open window (nor, before it, when its lifetime would reach the window), others'
//! sessions stay off owned GPUs' devices unless the site allows them, and an owner's session
//! never waits while a device of its group's GPUs that fits is left free.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;

use chrono::{DateTime, TimeZone, Utc};
use ongrid_core::job::{JobId, JobReason};
use ongrid_core::{
    ComputeCapability, GpuMode, GpuRequest, GpuUuid, HumanDuration, MemorySize, MigLayout,
    MigProfile, MigUuid, NodeName, SessionId, Sharing, UserName,
};
use ongrid_scheduler::{
    check_mig_satisfiable, plan, plan_mig, plan_mig_jobs, Access, Action, GpuSlot, MigJobAction,
    MigSlot, NodeState, PendingSession, Policy, QueuedJob, Reservation, RunningJob, SiteState,
};
use proptest::prelude::*;

const PROFILES: [&str; 5] = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "7g.80gb"];

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 25, 12, 0, 0).unwrap()
}

fn gpu_uuid(n: usize) -> GpuUuid {
    GpuUuid::parse(&format!("GPU-00000000-0000-0000-0000-{n:012}")).unwrap()
}

fn mig_uuid(n: usize) -> MigUuid {
    MigUuid::parse(&format!("MIG-00000000-0000-0000-0000-{n:012}")).unwrap()
}

/// A pending session through its JSON form, so fields this test does not care about keep
/// their defaults.
fn pending(n: usize, request: GpuRequest, pinned: Option<&str>) -> PendingSession {
    serde_json::from_value(serde_json::json!({
        "id": format!("00000000-0000-4000-8000-{n:012}"),
        "request": request,
        "queued_at": t0() + chrono::Duration::seconds(n as i64),
        "preferred_node": null,
        "pinned_node": pinned,
    }))
    .unwrap()
}

#[derive(Debug, Clone)]
struct Gpu {
    mig: bool,
    healthy: bool,
    drained: bool,
    /// (profile index, used) per device
    devices: Vec<(usize, bool)>,
}

#[derive(Debug, Clone)]
struct Node {
    online: bool,
    drained: bool,
    gpus: Vec<Gpu>,
}

fn gpu_strategy() -> impl Strategy<Value = Gpu> {
    (
        prop::bool::weighted(0.7),
        prop::bool::weighted(0.9),
        prop::bool::weighted(0.1),
        prop::collection::vec((0..PROFILES.len(), prop::bool::weighted(0.3)), 0..5),
    )
        .prop_map(|(mig, healthy, drained, devices)| Gpu {
            mig,
            healthy,
            drained,
            devices,
        })
}

/// (GPU count, sharing, pinned node) per session.
type Sessions = Vec<(usize, Sharing, Option<usize>)>;

fn site_strategy() -> impl Strategy<Value = (Vec<Node>, Sessions)> {
    let node = (
        prop::bool::weighted(0.9),
        prop::bool::weighted(0.1),
        prop::collection::vec(gpu_strategy(), 1..4),
    )
        .prop_map(|(online, drained, gpus)| Node {
            online,
            drained,
            gpus,
        });
    let sharing = prop_oneof![
        (0..PROFILES.len()).prop_map(|p| Sharing::Mig(PROFILES[p].parse().unwrap())),
        Just(Sharing::Exclusive),
        Just(Sharing::Shared),
        Just(Sharing::Any),
    ];
    (
        prop::collection::vec(node, 1..4),
        prop::collection::vec((0..3usize, sharing, prop::option::of(0..3usize)), 0..12),
    )
}

fn build(
    nodes: &[Node],
    sessions: &[(usize, Sharing, Option<usize>)],
) -> (SiteState, Vec<MigSlot>) {
    let mut slots = Vec::new();
    let mut n_gpu = 0;
    let mut n_dev = 0;
    let node_states = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let name = NodeName::parse(&format!("node{i}")).unwrap();
            let gpus = node
                .gpus
                .iter()
                .map(|gpu| {
                    n_gpu += 1;
                    let uuid = gpu_uuid(n_gpu);
                    let mode = if gpu.mig {
                        GpuMode::Mig {
                            layout: MigLayout::parse("1g.10gb*7").unwrap(),
                        }
                    } else {
                        GpuMode::Exclusive
                    };
                    for &(profile, used) in &gpu.devices {
                        n_dev += 1;
                        let profile: MigProfile = PROFILES[profile].parse().unwrap();
                        slots.push(MigSlot {
                            node: name.clone(),
                            uuid: mig_uuid(n_dev),
                            parent: uuid.clone(),
                            profile,
                            capability: ComputeCapability::new(8, 0),
                            memory: profile.nominal_memory(),
                            used,
                            job: None,
                        });
                    }
                    GpuSlot {
                        uuid,
                        capability: ComputeCapability::new(8, 0),
                        memory: MemorySize::from_mib(81_920),
                        mode,
                        healthy: gpu.healthy,
                        drained: gpu.drained,
                        used: 0,
                    }
                })
                .collect();
            NodeState {
                name,
                online: node.online,
                drained: node.drained,
                gpus,
            }
        })
        .collect();
    let pending = sessions
        .iter()
        .enumerate()
        .map(|(n, &(count, sharing, pin))| {
            let request = GpuRequest {
                count: if sharing.mig().is_some() {
                    1
                } else {
                    count as u32 + 1
                },
                min_capability: None,
                min_memory: None,
                sharing,
            };
            let pin = pin.filter(|&p| p < nodes.len()).map(|p| format!("node{p}"));
            pending(n, request, pin.as_deref())
        })
        .collect();
    let site = SiteState {
        nodes: node_states,
        pending,
        ..SiteState::default()
    };
    (site, slots)
}

fn usable(site: &SiteState, slot: &MigSlot) -> bool {
    site.nodes.iter().any(|n| {
        n.name == slot.node
            && n.online
            && !n.drained
            && n.gpus.iter().any(|g| {
                g.uuid == slot.parent
                    && g.healthy
                    && !g.drained
                    && matches!(g.mode, GpuMode::Mig { .. })
            })
    })
}

fn job_id(n: usize) -> JobId {
    format!("00000000-0000-4000-9000-{n:012}").parse().unwrap()
}

/// Gives every other used device of `slots` to a running job (the rest are held by sessions):
/// by turns halting already, within its min duration, or past it. Returns the running jobs.
fn jobs_on_devices(site: &mut SiteState, slots: &mut [MigSlot]) -> Vec<RunningJob> {
    let mut running = Vec::new();
    for (i, slot) in slots.iter_mut().enumerate() {
        if !slot.used || i % 2 == 1 {
            continue;
        }
        let mut job = job_on(slot, job_id(1000 + i), chrono::Duration::hours(2));
        job.min_duration = (i % 3 == 1).then(|| HumanDuration::from_secs(3 * 3600));
        job.halting = i % 3 == 0;
        running.push(job);
    }
    site.running_jobs = running.clone();
    running
}

/// Carol's job `id` on the device of `slot`, started `ago`, without durations.
fn job_on(slot: &mut MigSlot, id: JobId, ago: chrono::Duration) -> RunningJob {
    slot.job = Some(id);
    RunningJob {
        id,
        owner: UserName::parse("carol").unwrap(),
        node: slot.node.clone(),
        gpus: Vec::new(),
        started_at: t0() - ago,
        max_duration: None,
        min_duration: None,
        bucket: None,
        halting: false,
    }
}

/// (sharing, pinned node) per queued job.
type Jobs = Vec<(Sharing, Option<usize>)>;

fn jobs_strategy() -> impl Strategy<Value = Jobs> {
    let sharing = prop_oneof![
        (0..PROFILES.len()).prop_map(|p| Sharing::Mig(PROFILES[p].parse().unwrap())),
        Just(Sharing::Exclusive),
        Just(Sharing::Any),
    ];
    prop::collection::vec((sharing, prop::option::of(0..3usize)), 0..10)
}

fn queued_jobs(jobs: &Jobs, nodes: usize) -> Vec<QueuedJob> {
    jobs.iter()
        .enumerate()
        .map(|(n, &(sharing, pin))| QueuedJob {
            id: job_id(n),
            owner: UserName::parse("dave").unwrap(),
            request: GpuRequest {
                count: 1,
                min_capability: None,
                min_memory: None,
                sharing,
            },
            queued_at: t0() + chrono::Duration::seconds(n as i64),
            not_before: None,
            not_after: None,
            bucket: None,
            pinned_node: pin
                .filter(|&p| p < nodes)
                .map(|p| NodeName::parse(&format!("node{p}")).unwrap()),
            priority: Default::default(),
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn sessions_and_jobs_never_share_a_mig_device(
        (nodes, sessions) in site_strategy(),
        jobs in jobs_strategy(),
    ) {
        let (mut site, mut slots) = build(&nodes, &sessions);
        let running = jobs_on_devices(&mut site, &mut slots);
        site.queued_jobs = queued_jobs(&jobs, nodes.len());
        let now = t0();
        let actions = plan(&site, now);
        let placed = plan_mig(&site, &slots, t0());
        let mig_jobs = plan_mig_jobs(&site, &slots, now, &actions, &placed);

        // Every device given at most once, never one in use, always usable and sufficient.
        let mut given: HashSet<MigUuid> = placed.iter().map(|p| p.device.clone()).collect();
        prop_assert_eq!(given.len(), placed.len());
        let mut halted = Vec::new();
        for action in &mig_jobs {
            match action {
                MigJobAction::Start { job, node, device, parent } => {
                    prop_assert!(given.insert(device.clone()), "device {} given twice", device);
                    let slot = slots.iter().find(|s| &s.uuid == device).unwrap();
                    prop_assert!(!slot.used, "a used device was given to a job");
                    prop_assert!(usable(&site, slot), "an unusable device was given to a job");
                    prop_assert_eq!(&slot.node, node);
                    prop_assert_eq!(&slot.parent, parent);
                    let queued = site.queued_jobs.iter().find(|q| q.id == *job).unwrap();
                    let wanted = queued.request.sharing.mig().expect("only MIG jobs go to devices");
                    prop_assert!(slot.profile.covers(wanted));
                    if let Some(pin) = &queued.pinned_node {
                        prop_assert_eq!(pin, &slot.node);
                    }
                }
                MigJobAction::Halt { job, .. } => {
                    let held = running.iter().find(|r| r.id == *job);
                    prop_assert!(held.is_some(), "halted a job on no device");
                    let held = held.unwrap();
                    prop_assert!(!held.halting, "halted a job already halting");
                    prop_assert!(held.min_duration.is_none(), "halted a job within its min duration");
                    halted.push(*job);
                }
            }
        }
        let unique: HashSet<_> = halted.iter().collect();
        prop_assert_eq!(unique.len(), halted.len(), "a job halted twice");
        // No more halts than MIG sessions left waiting, each on a usable device that meets
        // one of them.
        let waiting: Vec<&PendingSession> = site
            .pending
            .iter()
            .filter(|s| s.request.sharing.mig().is_some() && !placed.iter().any(|p| p.session == s.id))
            .collect();
        prop_assert!(halted.len() <= waiting.len());
        for job in &halted {
            let slot = slots.iter().find(|s| s.job == Some(*job)).unwrap();
            prop_assert!(usable(&site, slot), "halted a job on an unusable device");
            prop_assert!(
                waiting.iter().any(|s| slot.profile.covers(s.request.sharing.mig().unwrap())),
                "halted a job whose device no waiting session can use"
            );
        }
        // A whole-GPU job never lands on a GPU in MIG mode.
        let mig_gpus: HashSet<&GpuUuid> = site
            .nodes
            .iter()
            .flat_map(|n| &n.gpus)
            .filter(|g| matches!(g.mode, GpuMode::Mig { .. }))
            .map(|g| &g.uuid)
            .collect();
        for action in &actions {
            if let Action::StartJob { job, gpus, .. } = action {
                let queued = site.queued_jobs.iter().find(|q| q.id == *job).unwrap();
                prop_assert!(queued.request.sharing.mig().is_none(), "a MIG job got whole GPUs");
                for gpu in gpus {
                    prop_assert!(!mig_gpus.contains(gpu), "{} is in MIG mode", gpu);
                }
            }
        }
        // The same plan for any input order.
        let mut reversed = site.clone();
        reversed.pending.reverse();
        reversed.nodes.reverse();
        reversed.queued_jobs.reverse();
        reversed.running_jobs.reverse();
        let mut rev_slots = slots.clone();
        rev_slots.reverse();
        let mut rev_actions = actions.clone();
        rev_actions.reverse();
        prop_assert_eq!(
            plan_mig_jobs(&reversed, &rev_slots, now, &rev_actions, &placed),
            mig_jobs
        );
    }

    #[test]
    fn mig_devices_are_never_shared_and_always_fit((nodes, sessions) in site_strategy()) {
        let (site, slots) = build(&nodes, &sessions);
        let placements = plan_mig(&site, &slots, t0());
        let mut seen = HashSet::new();
        let mut placed = HashSet::new();
        for p in &placements {
            prop_assert!(seen.insert(p.device.clone()), "device {} given twice", p.device);
            prop_assert!(placed.insert(p.session), "session placed twice");
            let slot = slots.iter().find(|s| s.uuid == p.device).unwrap();
            prop_assert!(!slot.used, "a used device was given");
            prop_assert!(usable(&site, slot), "an unusable device was given");
            prop_assert_eq!(&slot.node, &p.node);
            prop_assert_eq!(&slot.parent, &p.parent);
            let session = site.pending.iter().find(|s| s.id == p.session).unwrap();
            let wanted = session.request.sharing.mig().expect("only MIG requests are placed");
            prop_assert!(slot.profile.covers(wanted));
            if let Some(pin) = &session.pinned_node {
                prop_assert_eq!(pin, &slot.node);
            }
        }
        // Least sufficient first, and nobody waits while a device for them is left free.
        let free_after: Vec<&MigSlot> = slots
            .iter()
            .filter(|s| !s.used && !seen.contains(&s.uuid) && usable(&site, s))
            .collect();
        for session in &site.pending {
            let Some(wanted) = session.request.sharing.mig() else { continue };
            let fits = |s: &&&MigSlot| {
                s.profile.covers(wanted)
                    && session.pinned_node.as_ref().is_none_or(|pin| pin == &s.node)
            };
            match placements.iter().find(|p| p.session == session.id) {
                None => prop_assert!(
                    !free_after.iter().any(|s| fits(&s)),
                    "a session waits while a device that fits is free"
                ),
                Some(p) => {
                    let got = slots.iter().find(|s| s.uuid == p.device).unwrap().profile;
                    for s in free_after.iter().filter(|s| fits(s)) {
                        prop_assert!(
                            (got.slices, got.memory_gb) <= (s.profile.slices, s.profile.memory_gb),
                            "took {} while {} was free", got, s.profile
                        );
                    }
                }
            }
        }
        // The same plan for any input order.
        let mut reversed = site.clone();
        reversed.pending.reverse();
        reversed.nodes.reverse();
        let mut rev_slots = slots.clone();
        rev_slots.reverse();
        prop_assert_eq!(plan_mig(&reversed, &rev_slots, t0()), placements);
    }

    #[test]
    fn mig_devices_follow_their_gpus_owners_and_reservations(
        (nodes, sessions) in site_strategy(),
        rules in policy_strategy(),
    ) {
        let (mut site, slots) = build(&nodes, &sessions);
        let now = t0();
        site.policy = policy(&site, &rules);
        let policy = &site.policy;
        let placements = plan_mig(&site, &slots, now);
        let mut given = HashSet::new();
        for p in &placements {
            prop_assert!(given.insert(p.device.clone()), "device {} given twice", p.device);
            let access = policy.sessions.get(&p.session).cloned().unwrap_or_default();
            let group = access.group.as_deref();
            for r in policy.reservations.iter().filter(|r| r.gpus.contains(&p.parent)) {
                if r.group.as_str() == group.unwrap_or_default() {
                    continue;
                }
                prop_assert!(!r.active(now), "a device of {} went to {:?} in {}'s window", p.parent, group, r.name);
                if now < r.from {
                    let end = access.max_duration.map(|d| now + chrono::Duration::from_std(d.as_duration()).unwrap());
                    prop_assert!(end.is_some_and(|end| end <= r.from), "{:?}'s session would reach {}'s window", group, r.name);
                }
            }
            if let Some(name) = &access.reservation {
                let r = policy.reservations.iter().find(|r| &r.name == name).unwrap();
                prop_assert!(r.active(now) && r.gpus.contains(&p.parent), "a session naming {} went elsewhere", name);
            }
            if let Some(owner) = policy.owners.get(&p.parent) {
                let reserved_for_them = policy.reservations.iter().any(|r| {
                    r.active(now) && r.gpus.contains(&p.parent) && Some(r.group.as_str()) == group
                });
                prop_assert!(
                    Some(owner.as_str()) == group || policy.sessions_on_owned_gpus || reserved_for_them,
                    "{:?}'s session got a device of {}'s GPU", group, owner
                );
            }
        }
        // An owner's session waits only when no free device of its group's GPUs fits it.
        let placed: HashSet<SessionId> = placements.iter().map(|p| p.session).collect();
        for session in site.pending.iter().filter(|s| !placed.contains(&s.id)) {
            let Some(wanted) = session.request.sharing.mig() else { continue };
            let access = policy.sessions.get(&session.id).cloned().unwrap_or_default();
            if access.reservation.is_some() {
                continue;
            }
            let free_own = slots.iter().find(|s| {
                !s.used
                    && !given.contains(&s.uuid)
                    && usable(&site, s)
                    && s.profile.covers(wanted)
                    && session.pinned_node.as_ref().is_none_or(|pin| pin == &s.node)
                    && policy.owners.get(&s.parent).map(String::as_str) == access.group.as_deref()
                    && policy.reservations.iter().all(|r| {
                        !r.gpus.contains(&s.parent)
                            || r.to <= now
                            || Some(r.group.as_str()) == access.group.as_deref()
                    })
            });
            prop_assert!(free_own.is_none(), "an owner's session waits while {:?} is free", free_own.map(|s| &s.uuid));
        }
        // The same plan for any input order.
        let mut reversed = site.clone();
        reversed.pending.reverse();
        reversed.nodes.reverse();
        let mut rev_slots = slots.clone();
        rev_slots.reverse();
        prop_assert_eq!(plan_mig(&reversed, &rev_slots, now), placements);
    }

    #[test]
    fn whole_gpu_requests_never_land_on_a_mig_gpu((nodes, sessions) in site_strategy()) {
        let (site, _) = build(&nodes, &sessions);
        let mig_gpus: HashSet<&GpuUuid> = site
            .nodes
            .iter()
            .flat_map(|n| &n.gpus)
            .filter(|g| matches!(g.mode, GpuMode::Mig { .. }))
            .map(|g| &g.uuid)
            .collect();
        for action in plan(&site, t0()) {
            if let Action::Place { session, gpus, .. } = &action {
                let request = site.pending.iter().find(|s| s.id == *session).unwrap().request;
                prop_assert!(request.sharing.mig().is_none(), "a MIG request got whole GPUs");
                for gpu in gpus {
                    prop_assert!(!mig_gpus.contains(gpu), "{} is in MIG mode", gpu);
                }
            }
        }
    }
}

const GROUPS: [&str; 3] = ["atlas", "cms", "lhcb"];

/// Owners, reservations and who asks, as indices into the site's GPUs and sessions.
#[derive(Debug, Clone)]
struct Rules {
    /// Per GPU (by index, wrapping): an owner group, if any.
    owners: Vec<Option<usize>>,
    sessions_on_owned_gpus: bool,
    /// (group, GPUs by index, from and to in minutes from now)
    reservations: Vec<(usize, Vec<usize>, i64, i64)>,
    /// Per session (wrapping): group, the reservation it names, max lifetime in minutes.
    sessions: Vec<(usize, Option<usize>, Option<i64>)>,
}

fn policy_strategy() -> impl Strategy<Value = Rules> {
    (
        prop::collection::vec(prop::option::weighted(0.4, 0..GROUPS.len()), 1..8),
        prop::bool::weighted(0.3),
        prop::collection::vec(
            (
                0..GROUPS.len(),
                prop::collection::vec(0..12usize, 1..4),
                -120i64..120,
                1i64..240,
            ),
            0..4,
        ),
        prop::collection::vec(
            (
                0..GROUPS.len(),
                prop::option::weighted(0.2, 0..4usize),
                prop::option::weighted(0.8, 1i64..300),
            ),
            1..12,
        ),
    )
        .prop_map(
            |(owners, sessions_on_owned_gpus, reservations, sessions)| Rules {
                owners,
                sessions_on_owned_gpus,
                reservations: reservations
                    .into_iter()
                    .map(|(g, gpus, from, length)| (g, gpus, from, from + length))
                    .collect(),
                sessions,
            },
        )
}

fn policy(site: &SiteState, rules: &Rules) -> Policy {
    let gpus: Vec<&GpuUuid> = site
        .nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .map(|g| &g.uuid)
        .collect();
    let minutes = |m: i64| t0() + chrono::Duration::minutes(m);
    let reservations: Vec<Reservation> = rules
        .reservations
        .iter()
        .enumerate()
        .map(|(i, (group, on, from, to))| Reservation {
            name: format!("r{i}"),
            group: GROUPS[*group].to_owned(),
            gpus: on.iter().map(|&n| gpus[n % gpus.len()].clone()).collect(),
            from: minutes(*from),
            to: minutes(*to),
        })
        .collect();
    Policy {
        owners: gpus
            .iter()
            .enumerate()
            .filter_map(|(i, uuid)| {
                rules.owners[i % rules.owners.len()]
                    .map(|g| ((*uuid).clone(), GROUPS[g].to_owned()))
            })
            .collect(),
        sessions_on_owned_gpus: rules.sessions_on_owned_gpus,
        sessions: site
            .pending
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let (group, named, max) = rules.sessions[i % rules.sessions.len()];
                let access = Access {
                    group: Some(GROUPS[group].to_owned()),
                    reservation: named
                        .and_then(|r| reservations.get(r))
                        .map(|r| r.name.clone()),
                    max_duration: max.map(|m| HumanDuration::from_secs(m as u64 * 60)),
                };
                (s.id, access)
            })
            .collect(),
        reservations,
        jobs: Default::default(),
    }
}

#[test]
fn owners_sessions_go_first_on_their_devices_and_others_wait_for_a_reservation() {
    let nodes = vec![Node {
        online: true,
        drained: false,
        gpus: vec![
            Gpu {
                mig: true,
                healthy: true,
                drained: false,
                devices: vec![(0, false)],
            },
            Gpu {
                mig: true,
                healthy: true,
                drained: false,
                devices: vec![(0, false)],
            },
        ],
    }];
    let one_g = (0, Sharing::Mig(PROFILES[0].parse().unwrap()), None);
    // Two sessions: atlas's first in the queue, then cms's.
    let (mut site, slots) = build(&nodes, &[one_g, one_g]);
    let access = |group: &str| Access {
        group: Some(group.to_owned()),
        reservation: None,
        max_duration: Some(HumanDuration::from_secs(3600)),
    };
    let (atlas, cms) = (site.pending[0].id, site.pending[1].id);
    site.policy.sessions = [(atlas, access("atlas")), (cms, access("cms"))].into();
    // GPU 1 is cms's: cms's session takes its device, atlas's the other one.
    site.policy.owners = [(gpu_uuid(1), "cms".to_owned())].into();
    let placed = plan_mig(&site, &slots, t0());
    let got = |id| {
        placed
            .iter()
            .find(|p| p.session == id)
            .map(|p| p.parent.clone())
    };
    assert_eq!(got(cms), Some(gpu_uuid(1)));
    assert_eq!(got(atlas), Some(gpu_uuid(2)));
    // GPU 2 reserved for cms from now: atlas's session gets nothing (GPU 1 is owned).
    site.policy.reservations = vec![Reservation {
        name: "school".to_owned(),
        group: "cms".to_owned(),
        gpus: vec![gpu_uuid(2)],
        from: t0(),
        to: t0() + chrono::Duration::hours(2),
    }];
    let placed = plan_mig(&site, &slots, t0());
    assert_eq!(got_in(&placed, atlas), None);
    assert_eq!(got_in(&placed, cms), Some(gpu_uuid(1)));
    // An hour before the window, atlas's one-hour session ends in time and may take it.
    let early = t0() - chrono::Duration::hours(1);
    assert_eq!(
        got_in(&plan_mig(&site, &slots, early), atlas),
        Some(gpu_uuid(2))
    );
    // ... a minute later it would reach into the window.
    let late = early + chrono::Duration::minutes(1);
    assert_eq!(got_in(&plan_mig(&site, &slots, late), atlas), None);
}

fn got_in(placed: &[ongrid_scheduler::MigPlacement], id: SessionId) -> Option<GpuUuid> {
    placed
        .iter()
        .find(|p| p.session == id)
        .map(|p| p.parent.clone())
}

#[test]
fn a_request_no_device_can_meet_is_refused_naming_what_the_site_has() {
    let nodes = vec![Node {
        online: true,
        drained: false,
        gpus: vec![Gpu {
            mig: true,
            healthy: true,
            drained: false,
            devices: vec![(0, false), (2, true)],
        }],
    }];
    let (site, slots) = build(&nodes, &[]);
    let ask = |profile: &str| GpuRequest {
        count: 1,
        min_capability: None,
        min_memory: None,
        sharing: Sharing::Mig(profile.parse().unwrap()),
    };
    assert_eq!(
        check_mig_satisfiable(&site, &slots, &ask("2g.20gb")),
        Ok(())
    );
    let err = check_mig_satisfiable(&site, &slots, &ask("3g.40gb")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "no MIG device on the site is 3g.40gb or larger (the site has: 1g.10gb, 2g.20gb); ask for \
         a smaller profile, or an admin partitions a GPU with devctl admin gpu mode GPU mig:LAYOUT"
    );
    // The used 2g device is the only one that fits: the session waits for it.
    let site = SiteState {
        pending: vec![pending(1, ask("2g.20gb"), None)],
        ..site
    };
    assert!(plan_mig(&site, &slots, t0()).is_empty());
    let one_g = SiteState {
        pending: vec![pending(2, ask("1g.10gb"), None)],
        ..site
    };
    let placed = plan_mig(&one_g, &slots, t0());
    assert_eq!(placed.len(), 1);
    assert_eq!(placed[0].device, mig_uuid(1));
    assert_eq!(
        placed[0].session,
        "00000000-0000-4000-8000-000000000002"
            .parse::<SessionId>()
            .unwrap()
    );
}

#[test]
fn a_session_waits_for_a_halting_job_before_halting_another_and_never_one_within_its_min() {
    let nodes = vec![Node {
        online: true,
        drained: false,
        gpus: vec![Gpu {
            mig: true,
            healthy: true,
            drained: false,
            // Three used 1g devices: held by jobs 0 and 2 (see `jobs_on_devices`), and
            // by a session (device 1).
            devices: vec![(0, true), (0, true), (0, true)],
        }],
    }];
    let ask = GpuRequest {
        count: 1,
        min_capability: None,
        min_memory: None,
        sharing: Sharing::Mig("1g.10gb".parse().unwrap()),
    };
    let (mut site, mut slots) = build(&nodes, &[]);
    let running = jobs_on_devices(&mut site, &mut slots);
    assert_eq!(running.len(), 2);
    // Job 0 halts already; job 2 runs, past its min duration.
    assert!(running[0].halting && !running[1].halting);
    site.pending = vec![pending(1, ask, None)];
    let now = t0();
    let actions = plan(&site, now);
    assert!(plan_mig(&site, &slots, t0()).is_empty());
    // One session: it waits for the halting job, nothing more is halted.
    assert!(plan_mig_jobs(&site, &slots, now, &actions, &[]).is_empty());
    // A second session: the halting job is the first's, so the running one is halted for it.
    site.pending.push(pending(2, ask, None));
    let halts = plan_mig_jobs(&site, &slots, now, &actions, &[]);
    assert_eq!(
        halts,
        [MigJobAction::Halt {
            job: running[1].id,
            reason: ongrid_core::job::JobReason::ForInteractiveSession { need: ask },
        }]
    );
    // Within its min duration, it is not.
    site.running_jobs[1].min_duration = Some(HumanDuration::from_secs(3 * 3600));
    assert!(plan_mig_jobs(&site, &slots, now, &actions, &[]).is_empty());
}

#[test]
fn jobs_on_mig_devices_follow_their_gpus_owners_and_reservations() {
    // Two MIG GPUs of one 1g device each, both free; GPU 1 is cms's.
    let gpu = |used| Gpu {
        mig: true,
        healthy: true,
        drained: false,
        devices: vec![(0, used)],
    };
    let nodes = vec![Node {
        online: true,
        drained: false,
        gpus: vec![gpu(false), gpu(false)],
    }];
    let (mut site, slots) = build(&nodes, &[]);
    let ask = GpuRequest {
        count: 1,
        min_capability: None,
        min_memory: None,
        sharing: Sharing::Mig(PROFILES[0].parse().unwrap()),
    };
    let access = |group: &str| Access {
        group: Some(group.to_owned()),
        reservation: None,
        max_duration: Some(HumanDuration::from_secs(3600)),
    };
    site.queued_jobs = queued_jobs(&vec![(ask.sharing, None)], 1);
    let job = site.queued_jobs[0].id;
    site.policy.owners = [(gpu_uuid(1), "cms".to_owned())].into();
    let started_on = |site: &SiteState| {
        plan_mig_jobs(site, &slots, t0(), &[], &[])
            .into_iter()
            .find_map(|a| match a {
                MigJobAction::Start { parent, .. } => Some(parent),
                MigJobAction::Halt { .. } => None,
            })
    };
    // An owner's job goes to its group's device first; another group's, to the free one first,
    // and to the owned one as backfill.
    site.policy.jobs = [(job, access("cms"))].into();
    assert_eq!(started_on(&site), Some(gpu_uuid(1)));
    site.policy.jobs = [(job, access("atlas"))].into();
    assert_eq!(started_on(&site), Some(gpu_uuid(2)));
    // GPU 2 reserved for cms in an open window: atlas's job gets the owned device as backfill.
    site.policy.reservations = vec![Reservation {
        name: "school".to_owned(),
        group: "cms".to_owned(),
        gpus: vec![gpu_uuid(2)],
        from: t0(),
        to: t0() + chrono::Duration::hours(2),
    }];
    assert_eq!(started_on(&site), Some(gpu_uuid(1)));

    // Running: an atlas job on each device, within its min duration.
    let (mut site, mut slots) = build(
        &[Node {
            online: true,
            drained: false,
            gpus: vec![gpu(true), gpu(true)],
        }],
        &[],
    );
    let running: Vec<RunningJob> = slots
        .iter_mut()
        .enumerate()
        .map(|(i, slot)| RunningJob {
            min_duration: Some(HumanDuration::from_secs(3 * 3600)),
            ..job_on(slot, job_id(2000 + i), chrono::Duration::minutes(10))
        })
        .collect();
    site.running_jobs = running.clone();
    site.policy.owners = [(gpu_uuid(1), "cms".to_owned())].into();
    site.policy.jobs = running.iter().map(|j| (j.id, access("atlas"))).collect();
    // A cms session halts the atlas job on cms's device at once, its min duration
    // notwithstanding; an atlas session halts nothing within the min duration.
    site.pending = vec![pending(1, ask, None)];
    let session = site.pending[0].id;
    site.policy.sessions = [(session, access("cms"))].into();
    assert_eq!(
        plan_mig_jobs(&site, &slots, t0(), &[], &[]),
        [MigJobAction::Halt {
            job: running[0].id,
            reason: JobReason::ForOwnerWork {
                group: "cms".to_owned()
            },
        }]
    );
    site.policy.sessions = [(session, access("atlas"))].into();
    assert!(plan_mig_jobs(&site, &slots, t0(), &[], &[]).is_empty());
    // A reservation of cms opens on GPU 2: the atlas job there halts, the other keeps running.
    site.pending.clear();
    site.policy.reservations = vec![Reservation {
        name: "school".to_owned(),
        group: "cms".to_owned(),
        gpus: vec![gpu_uuid(2)],
        from: t0(),
        to: t0() + chrono::Duration::hours(2),
    }];
    assert_eq!(
        plan_mig_jobs(&site, &slots, t0() - chrono::Duration::seconds(1), &[], &[]),
        []
    );
    assert_eq!(
        plan_mig_jobs(&site, &slots, t0(), &[], &[]),
        [MigJobAction::Halt {
            job: running[1].id,
            reason: JobReason::ReservationStarted {
                reservation: "school".to_owned(),
                group: "cms".to_owned(),
            },
        }]
    );
}
