//! Property tests of `plan` and `check_satisfiable` on random sites.
//!
//! `reference_plan` below is a naive planner written straight from the rules in the crate
//! documentation: for every session it looks at every GPU of every node. The fast planner must
//! give exactly its plan. Independently of any reference, every plan is checked for the
//! invariants: nothing over-allocated, every requirement met, the same plan for any input
//! order, least capable GPUs first, first come first served among equal requests, and a session
//! left waiting only when no room for it remains.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use chrono::{DateTime, TimeZone, Utc};
use ongrid_core::{
    ComputeCapability, GpuMode, GpuRequest, GpuUuid, MemorySize, NodeName, SessionId, Sharing,
};
use ongrid_scheduler::{
    check_satisfiable, plan, Action, GpuSlot, NodeState, PendingSession, SiteState,
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
    }
}

fn fits(request: &GpuRequest, slot: &GpuSlot) -> bool {
    request.fits(slot.capability, slot.memory, slot.mode)
}

fn queue_order(site: &SiteState) -> Vec<&PendingSession> {
    let mut queue: Vec<_> = site.pending.iter().collect();
    queue.sort_by_key(|session| (session.queued_at, session.id));
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

fn reference_plan(site: &SiteState) -> Vec<Action> {
    let mut free = free_places(site);
    let mut actions = Vec::new();
    for session in queue_order(site) {
        let request = &session.request;
        if request.validate().is_err() {
            continue;
        }
        let pinned = session
            .pinned_node
            .as_ref()
            .map(|name| site.nodes.iter().find(|node| &node.name == name));
        let preferred = session
            .preferred_node
            .as_ref()
            .and_then(|name| site.nodes.iter().find(|node| &node.name == name))
            .and_then(|node| Some((node, least_on_node(node, request, &free)?)));
        let chosen = if let Some(pinned) = pinned {
            pinned.and_then(|node| Some((node, least_on_node(node, request, &free)?)))
        } else {
            preferred.or_else(|| {
                let options = site
                    .nodes
                    .iter()
                    .filter_map(|node| Some((node, least_on_node(node, request, &free)?)));
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
                        let top_down: Vec<_> =
                            gpus.iter().rev().map(|gpu| class_key(gpu)).collect();
                        (top_down, node.name.clone())
                    })
                }
            })
        };
        if let Some((node, gpus)) = chosen {
            for gpu in &gpus {
                *free.get_mut(&gpu.uuid).expect("a chosen GPU is free") -= 1;
            }
            actions.push(Action::Place {
                session: session.id,
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
        .map(|action| match action {
            Action::Place {
                session,
                node,
                gpus,
            } => (*session, (node, gpus.as_slice())),
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
        })
        .collect();
    SiteState { nodes, pending }
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
        prop_assert_eq!(&actions, &reference_plan(&site));
        prop_assert_eq!(&actions, &plan(&shuffled(&site, seed), at(100)));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn larger_sites(site in site_strategy(40, 8, 300), seed in any::<u64>()) {
        let actions = plan(&site, at(100));
        check_invariants(&site, &actions)?;
        prop_assert_eq!(&actions, &reference_plan(&site));
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

/// The invariant checker must catch a broken plan, or the properties above prove nothing.
#[test]
fn the_invariant_checker_catches_broken_plans() {
    let gpu = |n: usize, capability: &str, mode: GpuMode| GpuSlot {
        uuid: gpu_uuid(n),
        capability: capability.parse().expect("valid"),
        memory: "40G".parse().expect("valid"),
        mode,
        healthy: true,
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
    };
    let site_with = |pending: Vec<PendingSession>| SiteState {
        nodes: vec![NodeState {
            name: node_name(1),
            online: true,
            gpus: vec![
                gpu(1, "7.5", GpuMode::Exclusive),
                gpu(2, "9.0", GpuMode::Exclusive),
                gpu(3, "8.0", GpuMode::Shared { max_sessions: 2 }),
            ],
        }],
        pending,
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
    assert_eq!(reference_plan(&site), good);
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
