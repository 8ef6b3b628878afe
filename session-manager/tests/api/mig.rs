//! MIG over the real API: an admin's layout checked against the GPU's model, sent to the
//! node's agent in its desired state; the devices the agent reports become places for sessions
//! that ask for a MIG device (least sufficient first, one session each), never for whole-GPU
//! requests; `GET /v1/nodes` shows which session holds which device.

use ongrid_core::api::SetGpuMode;
use ongrid_core::{GpuId, GpuMode, MigDevice, MigLayout, MigUuid, Sharing};

use super::*;

const A100_80: &str = "NVIDIA A100-SXM4-80GB";

fn a100_80() -> GpuInfo {
    GpuInfo {
        model: A100_80.to_owned(),
        memory: MemorySize::from_mib(81_920),
        ..a100(1)
    }
}

/// The GPU after its agent made `layout`: MIG mode on, one device per instance.
fn partitioned(layout: &str) -> GpuInfo {
    let gpu = a100_80();
    let layout: MigLayout = layout.parse().unwrap();
    let mig_devices = layout
        .instances()
        .into_iter()
        .enumerate()
        .map(|(i, profile)| MigDevice {
            uuid: MigUuid::parse(&format!("MIG-aaaaaaaa-bbbb-cccc-dddd-0000000000{i:02}")).unwrap(),
            profile,
            memory: profile.nominal_memory(),
            parent: gpu.uuid.clone(),
        })
        .collect();
    GpuInfo {
        mig_enabled: true,
        mig_devices,
        ..gpu
    }
}

fn mig(profile: &str) -> GpuRequest {
    GpuRequest {
        sharing: Sharing::Mig(profile.parse().unwrap()),
        ..GpuRequest::default()
    }
}

fn mode(text: &str) -> SetGpuMode {
    SetGpuMode {
        mode: text.parse().unwrap(),
    }
}

#[tokio::test]
async fn sessions_get_mig_devices_of_the_admins_layout() {
    let site = Site::new();
    let m = site.start().await;
    let gpu = a100_80();
    m.node1.register("node1", vec![gpu.clone()]).await;
    let path = format!("/v1/gpus/{}/mode", gpu.uuid);

    // Checked against the model's profiles.
    let refused = m
        .admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.put(&path, &mode("mig:1g.5gb*7")),
        )
        .await;
    assert_eq!(
        refused.error.message,
        format!(
            "mig:1g.5gb*7 on {}: A100-80GB has no MIG profile 1g.5gb; its profiles are 1g.10gb, \
             1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb",
            gpu.uuid
        )
    );
    let refused = m
        .admin
        .fails(
            StatusCode::BAD_REQUEST,
            m.admin.put(&path, &mode("mig:3g.40gb*3")),
        )
        .await;
    assert!(
        refused
            .error
            .message
            .contains("at most 2 instance(s) of 3g.40gb"),
        "{}",
        refused.error.message
    );
    let view: GpuView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin.put(&path, &mode("mig:3g.40gb*1+2g.20gb*2")),
        )
        .await;
    assert_eq!(view.mode.to_string(), "mig:3g.40gb*1+2g.20gb*2");

    // The agent is told; until it reports devices, no session can get one, and a whole GPU is
    // never given out from a GPU in MIG mode.
    let desired = m.node1.sync("node1", vec![gpu.clone()], Vec::new()).await;
    assert_eq!(
        desired.mig_layouts.get(&gpu.uuid).map(ToString::to_string),
        Some("3g.40gb*1+2g.20gb*2".to_owned())
    );
    let early = m
        .alice
        .fails(
            StatusCode::UNPROCESSABLE_ENTITY,
            m.alice.post(
                "/v1/sessions",
                &CreateSession {
                    name: None,
                    gpus: mig("1g.10gb"),
                    image: None,
                    idle_timeout_secs: None,
                    max_duration_secs: None,
                },
            ),
        )
        .await;
    assert!(
        early
            .error
            .message
            .starts_with("no MIG device on the site is 1g.10gb or larger (the site has: none)"),
        "{}",
        early.error.message
    );
    m.alice
        .fails(
            StatusCode::UNPROCESSABLE_ENTITY,
            m.alice.post(
                "/v1/sessions",
                &CreateSession {
                    name: None,
                    gpus: one_gpu(),
                    image: None,
                    idle_timeout_secs: None,
                    max_duration_secs: None,
                },
            ),
        )
        .await;

    // The agent made the layout: sessions get its devices, smallest sufficient first.
    let gpu = partitioned("3g.40gb*1+2g.20gb*2");
    m.node1.register("node1", vec![gpu.clone()]).await;
    m.alice.create(Some("small"), mig("1g.10gb")).await;
    let small = m.alice.wait_for("small", SessionState::Starting).await;
    let two_g: Vec<GpuId> = gpu.mig_devices[1..]
        .iter()
        .map(|d| GpuId::Mig(d.uuid.clone()))
        .collect();
    assert_eq!(small.gpus.len(), 1);
    assert!(
        two_g.contains(&small.gpus[0]),
        "{:?} is not a 2g device",
        small.gpus
    );
    assert!(small.reason.contains("MIG device"), "{}", small.reason);
    m.alice.create(Some("big"), mig("3g.40gb")).await;
    let big = m.alice.wait_for("big", SessionState::Starting).await;
    assert_eq!(big.gpus, [GpuId::Mig(gpu.mig_devices[0].uuid.clone())]);
    m.alice.create(Some("other"), mig("2g.20gb")).await;
    let other = m.alice.wait_for("other", SessionState::Starting).await;
    assert_ne!(other.gpus, small.gpus, "two sessions on one MIG device");
    // All three devices are taken: the next one waits.
    let last = m.alice.create(Some("last"), mig("1g.10gb")).await;
    assert_eq!(last.state, SessionState::Pending);

    // The node's desired state carries the MIG UUID as the session's device.
    let desired = m.node1.sync("node1", vec![gpu.clone()], Vec::new()).await;
    let on_node: Vec<&GpuId> = desired.sessions.iter().flat_map(|s| &s.gpus).collect();
    assert_eq!(on_node.len(), 3);
    assert!(on_node.iter().all(|id| matches!(id, GpuId::Mig(_))));

    let nodes: Vec<NodeView> = m.admin.ok(StatusCode::OK, m.admin.get("/v1/nodes")).await;
    let view = &nodes[0].gpus[0];
    assert!(matches!(view.mode, GpuMode::Mig { .. }));
    assert_eq!((view.used, view.free), (3, 0));
    assert_eq!(view.mig_sessions.len(), 3);
    assert_eq!(
        view.mig_sessions
            .get(&gpu.mig_devices[0].uuid)
            .map(|s| s.as_str()),
        Some("big")
    );
}

#[tokio::test]
async fn a_queued_session_says_when_drained_gpus_are_why_it_waits() {
    let site = Site::new();
    let m = site.start().await;
    m.node1.register("node1", vec![a100(1)]).await;
    let drain = ongrid_core::api::DrainRequest {
        reason: Some("fan noise".to_owned()),
    };
    let _: GpuView = m
        .admin
        .ok(
            StatusCode::OK,
            m.admin
                .post(&format!("/v1/gpus/{}/drain", a100(1).uuid), &drain),
        )
        .await;
    let queued = m.alice.create(Some("queued"), one_gpu()).await;
    assert_eq!(queued.state, SessionState::Pending);
    let expected = format!(
        "waits: GPUs that fit it are out of service (1 fit in all): {} on node1 drained ",
        a100(1).uuid
    );
    assert!(queued.reason.contains(&expected), "{}", queued.reason);
    assert!(queued.reason.ends_with(": fan noise"), "{}", queued.reason);
    let shown = m.alice.show("queued").await;
    assert!(shown.reason.contains(&expected), "{}", shown.reason);
}
