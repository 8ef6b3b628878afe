//! Tests of the SQLite store against a real database file in a temporary directory.

use chrono::TimeZone;
use ongrid_core::{ComputeCapability, GpuId, GpuRequest, MemorySize, Sharing};

use super::*;

fn t(secs: i64) -> DateTime<Utc> {
    // Nanoseconds included, to prove timestamps round-trip exactly.
    Utc.timestamp_opt(1_700_000_000 + secs, 123_456_789)
        .unwrap()
}

fn dn(cn: &str) -> Dn {
    Dn::parse(&format!("/DC=org/DC=example/CN={cn}")).unwrap()
}

fn gpu(n: u8) -> GpuInfo {
    GpuInfo {
        uuid: GpuUuid::parse(&format!("GPU-11111111-2222-3333-4444-5555555555{n:02}")).unwrap(),
        model: "NVIDIA A100-SXM4-40GB".to_owned(),
        capability: ComputeCapability::new(8, 0),
        memory: MemorySize::from_mib(40_960),
        pci_bus_id: Some(format!("00000000:{n:02}:00.0")),
        driver_version: Some("550.54.15".to_owned()),
        mig_enabled: false,
        health: GpuHealth::Healthy,
    }
}

fn node(name: &str) -> NodeRegistration {
    NodeRegistration {
        name: NodeName::parse(name).unwrap(),
        gpu_backend: "simulated".to_owned(),
        agent_version: "0.1.0".to_owned(),
    }
}

fn new_session(owner: &Dn, name: Option<&str>, at: DateTime<Utc>) -> NewSession {
    NewSession {
        id: SessionId::new_random(),
        name: name.map(|n| SessionName::parse(n).unwrap()),
        owner: owner.clone(),
        request: GpuRequest {
            count: 1,
            min_capability: Some(ComputeCapability::new(8, 0)),
            min_memory: None,
            sharing: Sharing::Exclusive,
        },
        image: "ongrid/dev:latest".to_owned(),
        at,
        reason: "created".to_owned(),
    }
}

fn change(to: SessionState, at: DateTime<Utc>, reason: &str, placement: Placement) -> Change {
    Change {
        to,
        at,
        reason: reason.to_owned(),
        placement,
    }
}

async fn open(dir: &tempfile::TempDir) -> SqliteStore {
    SqliteStore::open(&dir.path().join("manager.db"))
        .await
        .unwrap()
}

#[tokio::test]
async fn a_reopened_file_gives_everything_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    let alice = store.user(&dn("Alice Smith"), 20_000).await.unwrap();
    store
        .register_node(node("node1"), &[gpu(1), gpu(2)], t(0))
        .await
        .unwrap();
    let shared = GpuMode::Shared { max_sessions: 4 };
    store.set_gpu_mode(&gpu(2).uuid, shared).await.unwrap();
    let created = store
        .create_session(new_session(&alice.dn, Some("train1"), t(1)))
        .await
        .unwrap();
    let placement = Placement::Place {
        node: NodeName::parse("node1").unwrap(),
        gpus: vec![GpuId::Gpu(gpu(1).uuid)],
    };
    store
        .transition(
            created.id,
            change(SessionState::Starting, t(2), "placed on node1", placement),
        )
        .await
        .unwrap();
    let before_session = store.session(created.id).await.unwrap().unwrap();
    let before_history = store.transitions(created.id).await.unwrap();
    let before_nodes = store.nodes().await.unwrap();
    store.close().await;
    drop(store);

    let store = open(&dir).await;
    assert_eq!(store.user(&alice.dn, 20_000).await.unwrap(), alice);
    assert_eq!(
        store.session(created.id).await.unwrap().unwrap(),
        before_session
    );
    assert_eq!(store.transitions(created.id).await.unwrap(), before_history);
    assert_eq!(store.nodes().await.unwrap(), before_nodes);
    assert_eq!(before_session.state, SessionState::Starting);
    assert_eq!(before_session.created_at, t(1));
    assert_eq!(before_history.len(), 2);
    assert_eq!(before_history[1].at, t(2));
    assert_eq!(before_nodes[0].gpus[1].mode, shared);
}

#[tokio::test]
async fn transitions_go_through_the_lifecycle() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let session = store
        .create_session(new_session(&alice.dn, None, t(0)))
        .await
        .unwrap();
    assert_eq!(session.state, SessionState::Pending);
    assert_eq!(session.reason, "created");

    let err = store
        .transition(
            session.id,
            change(SessionState::Connected, t(1), "x", Placement::Keep),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::InvalidTransition(ref e) if e.from == SessionState::Pending),
        "{err}"
    );
    assert_eq!(store.transitions(session.id).await.unwrap().len(), 1);

    let node1 = NodeName::parse("node1").unwrap();
    store
        .register_node(node("node1"), &[gpu(1)], t(0))
        .await
        .unwrap();
    let placed = store
        .transition(
            session.id,
            change(
                SessionState::Starting,
                t(1),
                "placed",
                Placement::Place {
                    node: node1.clone(),
                    gpus: vec![GpuId::Gpu(gpu(1).uuid)],
                },
            ),
        )
        .await
        .unwrap();
    assert_eq!(placed.node.as_ref(), Some(&node1));
    assert_eq!(placed.gpus, vec![GpuId::Gpu(gpu(1).uuid)]);
    let back = store
        .transition(
            session.id,
            change(
                SessionState::Pending,
                t(2),
                "node1 stopped responding",
                Placement::Clear,
            ),
        )
        .await
        .unwrap();
    assert_eq!(back.node, None);
    assert!(back.gpus.is_empty());
    assert_eq!(back.queued_at, t(0), "a re-queued session keeps its place");
    let ended = store
        .transition(
            session.id,
            change(
                SessionState::Ended,
                t(3),
                "removed by alice",
                Placement::Keep,
            ),
        )
        .await
        .unwrap();
    assert_eq!(ended.reason, "removed by alice");
    let history = store.transitions(session.id).await.unwrap();
    let states: Vec<_> = history.iter().map(|t| (t.from, t.to)).collect();
    use SessionState::*;
    assert_eq!(
        states,
        vec![
            (None, Pending),
            (Some(Pending), Starting),
            (Some(Starting), Pending),
            (Some(Pending), Ended)
        ]
    );
    let missing = SessionId::new_random();
    assert!(matches!(
        store
            .transition(missing, change(Ended, t(4), "x", Placement::Keep))
            .await,
        Err(StoreError::NoSuchSession(id)) if id == missing
    ));
}

#[tokio::test]
async fn names_are_unique_per_owner_among_sessions_that_have_not_ended() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let bob = store.user(&dn("Bob"), 20_000).await.unwrap();
    let first = store
        .create_session(new_session(&alice.dn, Some("train1"), t(0)))
        .await
        .unwrap();
    let err = store
        .create_session(new_session(&alice.dn, Some("train1"), t(1)))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::NameTaken { name, state: SessionState::Pending } if name.as_str() == "train1"),
        "{err}"
    );
    // Another user may use the same name.
    store
        .create_session(new_session(&bob.dn, Some("train1"), t(1)))
        .await
        .unwrap();
    // Once ended, the name is free again; lookups prefer the live session.
    store
        .transition(
            first.id,
            change(SessionState::Ended, t(2), "removed", Placement::Keep),
        )
        .await
        .unwrap();
    let second = store
        .create_session(new_session(&alice.dn, Some("train1"), t(3)))
        .await
        .unwrap();
    let name = SessionName::parse("train1").unwrap();
    let found = store
        .session_by_name(&alice.dn, &name)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.id, second.id);
    store
        .transition(
            second.id,
            change(SessionState::Ended, t(4), "removed", Placement::Keep),
        )
        .await
        .unwrap();
    let found = store
        .session_by_name(&alice.dn, &name)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.id, second.id, "the last ended one when none is live");

    // Default names: dev, dev-2, ... filling the first gap.
    let mut ids = Vec::new();
    for (i, expected) in ["dev", "dev-2", "dev-3"].into_iter().enumerate() {
        let s = store
            .create_session(new_session(&alice.dn, None, t(10 + i as i64)))
            .await
            .unwrap();
        assert_eq!(s.name.as_str(), expected);
        ids.push(s.id);
    }
    store
        .transition(
            ids[1],
            change(SessionState::Ended, t(20), "removed", Placement::Keep),
        )
        .await
        .unwrap();
    let refill = store
        .create_session(new_session(&alice.dn, None, t(21)))
        .await
        .unwrap();
    assert_eq!(refill.name.as_str(), "dev-2");

    let mine = store
        .sessions(SessionFilter::Owner(alice.dn.clone()))
        .await
        .unwrap();
    let names: Vec<_> = mine.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["dev", "dev-3", "dev-2"],
        "ENDED sessions are not listed"
    );
    assert_eq!(store.sessions(SessionFilter::All).await.unwrap().len(), 4);
}

#[tokio::test]
async fn users_get_stable_unique_names_and_uids() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    let a1 = store.user(&dn("Alice Smith"), 20_000).await.unwrap();
    let a2 = store
        .user(
            &Dn::parse("/DC=org/DC=other/CN=Alice Smith").unwrap(),
            20_000,
        )
        .await
        .unwrap();
    let a3 = store
        .user(&Dn::parse("/O=third/CN=Alice Smith").unwrap(), 20_000)
        .await
        .unwrap();
    assert_eq!((a1.user_name.as_str(), a1.uid), ("alice-smith", 20_000));
    assert_eq!((a2.user_name.as_str(), a2.uid), ("alice-smith-2", 20_001));
    assert_eq!((a3.user_name.as_str(), a3.uid), ("alice-smith-3", 20_002));
    // Asking again gives the same record, even with another first_uid.
    assert_eq!(store.user(&a2.dn, 30_000).await.unwrap(), a2);
    // A raised first_uid applies to new users.
    let bob = store.user(&dn("Bob"), 30_000).await.unwrap();
    assert_eq!(bob.uid, 30_000);
    let carol = store.user(&dn("Carol"), 20_000).await.unwrap();
    assert_eq!(carol.uid, 30_001);
}

#[tokio::test]
async fn nodes_keep_gpu_modes_and_mark_vanished_gpus_failed() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    let node1 = NodeName::parse("node1").unwrap();
    assert!(!store.record_sync(&node1, &[gpu(1)], t(0)).await.unwrap());
    store
        .register_node(node("node1"), &[gpu(1), gpu(2)], t(0))
        .await
        .unwrap();
    let shared = GpuMode::Shared { max_sessions: 3 };
    let updated = store
        .set_gpu_mode(&gpu(1).uuid, shared)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(updated.mode, shared);
    let unknown = GpuUuid::parse("GPU-99999999-2222-3333-4444-555555555599").unwrap();
    assert_eq!(store.set_gpu_mode(&unknown, shared).await.unwrap(), None);

    // Re-registering keeps the admin's mode; GPU 2 is gone and shows as failed.
    let mut sick = gpu(1);
    sick.driver_version = Some("555.0".to_owned());
    store
        .register_node(node("node1"), &[sick.clone()], t(5))
        .await
        .unwrap();
    let nodes = store.nodes().await.unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0].last_seen, t(5));
    assert_eq!(nodes[0].gpus[0].mode, shared);
    assert_eq!(nodes[0].gpus[0].info, sick);
    assert_eq!(
        nodes[0].gpus[1].info.health,
        GpuHealth::Failed("no longer reported by node node1's agent".to_owned())
    );
    assert_eq!(nodes[0].gpus[1].mode, GpuMode::Exclusive);

    // A sync records health and the time.
    sick.health = GpuHealth::Failed("fell off the bus".to_owned());
    assert!(store
        .record_sync(&node1, &[sick.clone(), gpu(2)], t(9))
        .await
        .unwrap());
    let nodes = store.nodes().await.unwrap();
    assert_eq!(nodes[0].last_seen, t(9));
    assert_eq!(nodes[0].gpus[0].info.health, sick.health);
    assert!(nodes[0].gpus[1].info.health.is_healthy());
}

#[tokio::test]
async fn the_queue_is_ordered_by_time_then_id() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    let alice = store.user(&dn("Alice"), 20_000).await.unwrap();
    let late = store
        .create_session(new_session(&alice.dn, Some("late"), t(10)))
        .await
        .unwrap();
    let early = store
        .create_session(new_session(&alice.dn, Some("early"), t(1)))
        .await
        .unwrap();
    let mut same_a = new_session(&alice.dn, Some("same-a"), t(5));
    let mut same_b = new_session(&alice.dn, Some("same-b"), t(5));
    same_a.id = SessionId("00000000-0000-4000-8000-000000000002".parse().unwrap());
    same_b.id = SessionId("00000000-0000-4000-8000-000000000001".parse().unwrap());
    store.create_session(same_a.clone()).await.unwrap();
    store.create_session(same_b.clone()).await.unwrap();
    assert_eq!(
        store.pending_order().await.unwrap(),
        vec![early.id, same_b.id, same_a.id, late.id]
    );
    let pending = store
        .sessions(SessionFilter::States(vec![SessionState::Pending]))
        .await
        .unwrap();
    assert_eq!(pending.len(), 4);
    assert!(store
        .sessions(SessionFilter::States(vec![SessionState::Starting]))
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn concurrent_writers_do_not_fail() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    let owners: Vec<Dn> = (0..8).map(|i| dn(&format!("User {i}"))).collect();
    let tasks: Vec<_> = owners
        .iter()
        .map(|owner| {
            let store = store.clone();
            let owner = owner.clone();
            tokio::spawn(async move {
                store.user(&owner, 20_000).await.unwrap();
                for _ in 0..3 {
                    store
                        .create_session(new_session(&owner, None, t(0)))
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(store.sessions(SessionFilter::All).await.unwrap().len(), 24);
    let uids: BTreeSet<u32> = {
        let mut uids = BTreeSet::new();
        for owner in &owners {
            uids.insert(store.user(owner, 20_000).await.unwrap().uid);
        }
        uids
    };
    assert_eq!(uids, (20_000..20_008).collect());
}
