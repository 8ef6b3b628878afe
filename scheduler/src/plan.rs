//! [`plan`]: which pending sessions start where, now.
//!
//! Sessions are served first come, first served, one at a time, each taking the best fitting
//! place left (see the crate documentation for the rules). A session that does not fit is
//! skipped and the next one tried (backfill). Free capacity only shrinks while planning, so a
//! request shape that once found no room never will again in the same plan: later sessions of
//! that shape are skipped without a search, which keeps a long queue on a full site cheap.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use ongrid_core::{ComputeCapability, MemorySize, Sharing};

use crate::index::Index;
use crate::site::{Action, PendingSession, SiteState};

/// A request without its count: what each of its GPUs must be.
type Shape = (Option<ComputeCapability>, Option<MemorySize>, Sharing);

/// Places pending sessions onto free GPU slots of online nodes.
///
/// Returns one [`Action::Place`] per session that can start now, in the order the sessions were
/// served, `(queued_at, id)`. The result depends only on the contents of `site`, not on the order
/// of its vectors. A session with an invalid request (0 GPUs, or more than
/// [`ongrid_core::GpuRequest::MAX_COUNT`]) is never placed.
///
/// `now` is the time of the plan. No rule looks at it yet; it is part of the signature so that
/// time-based rules (reservations, aging) can come without changing callers.
pub fn plan(site: &SiteState, now: DateTime<Utc>) -> Vec<Action> {
    let _ = now;
    let mut index = Index::new(site);
    let mut queue: Vec<&PendingSession> = site.pending.iter().collect();
    queue.sort_by_key(|session| (session.queued_at, session.id));

    // Per shape, the fewest GPUs that found no room.
    let mut no_room: HashMap<Shape, u32> = HashMap::new();
    let mut actions = Vec::new();
    for session in queue {
        let request = &session.request;
        if request.validate().is_err() {
            continue;
        }
        let shape = (request.min_capability, request.min_memory, request.sharing);
        if no_room
            .get(&shape)
            .is_some_and(|&fewest| fewest <= request.count)
        {
            continue;
        }
        match choose(&index, session) {
            Some((node, gpus)) => {
                index.take(node, &gpus);
                actions.push(Action::Place {
                    session: session.id,
                    node: index.node_name(node).clone(),
                    gpus: gpus.iter().map(|&gpu| index.uuid(gpu).clone()).collect(),
                });
            }
            // A pinned session found no room on one node only: others may still have some.
            None if session.pinned_node.is_some() => {}
            None => {
                let fewest = no_room.entry(shape).or_insert(request.count);
                *fewest = (*fewest).min(request.count);
            }
        }
    }
    actions
}

/// The node and GPUs for one session, or `None` when nothing fits now.
fn choose(index: &Index<'_>, session: &PendingSession) -> Option<(usize, Vec<usize>)> {
    let request = &session.request;
    let fits = index.fitting_classes(request);
    if let Some(pinned) = &session.pinned_node {
        let node = index.node_named(pinned)?;
        if let Some(gpus) =
            index.these_free_gpus_on(node, &fits, &session.previous_gpus, request.count)
        {
            return Some((node, gpus));
        }
        let gpus = index.least_free_gpus_on(node, &fits, request.count)?;
        return Some((node, gpus));
    }
    if let Some(preferred) = session
        .preferred_node
        .as_ref()
        .and_then(|name| index.node_named(name))
    {
        if let Some(gpus) = index.least_free_gpus_on(preferred, &fits, request.count) {
            return Some((preferred, gpus));
        }
    }
    if request.count == 1 {
        let gpu = index.least_free_gpu(&fits)?;
        return Some((index.node_of(gpu), vec![gpu]));
    }
    let node = index.best_node(&fits, request.count)?;
    let gpus = index.least_free_gpus_on(node, &fits, request.count)?;
    Some((node, gpus))
}

#[cfg(test)]
mod tests {
    use ongrid_core::Sharing::{Any, Exclusive, Shared};

    use super::*;
    use crate::testing::*;

    fn site(nodes: Vec<crate::NodeState>, pending: Vec<PendingSession>) -> SiteState {
        SiteState { nodes, pending }
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
}
