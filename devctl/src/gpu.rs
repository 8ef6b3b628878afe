//! `devctl gpus`: the site's nodes and GPUs (`GET /v1/nodes`), one row per GPU: model,
//! capability, memory, mode, use, health (and drains), sessions.

use ongrid_core::api::{GpuView, NodeView};
use ongrid_core::GpuHealth;

use crate::client::Client;
use crate::format::format_time;
use crate::table::Table;
use crate::terminal::{JsonArgs, Terminal};

pub async fn run(args: JsonArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let nodes: Vec<NodeView> = client.get("v1/nodes").send().await?;
    let width = term.width;
    term.show(args.json, &nodes, |nodes| render(nodes, width))
}

fn health(node: &NodeView, gpu: &GpuView) -> String {
    match (&gpu.info.health, &gpu.drain, &node.drain) {
        (GpuHealth::Failed(reason), _, _) => format!("FAILED: {reason}"),
        (GpuHealth::Unknown(reason), _, _) => format!("UNKNOWN: {reason}"),
        (GpuHealth::Healthy, _, _) if !node.online => {
            format!("node offline since {}", format_time(node.last_seen))
        }
        (GpuHealth::Healthy, Some(drain), _) => format!("ok, DRAINED: {}", drain.reason),
        (GpuHealth::Healthy, None, Some(drain)) => {
            format!("ok, node DRAINED: {}", drain.reason)
        }
        (GpuHealth::Healthy, None, None) => "ok".to_owned(),
    }
}

/// One row per GPU, nodes in the manager's order; offline and drained nodes are marked. Wrapped to `width`
/// (the terminal's) when given, GPU UUIDs kept whole.
pub fn render(nodes: &[NodeView], width: Option<u16>) -> String {
    if nodes.is_empty() {
        return "no nodes: no node agent has registered with the manager yet\n".to_owned();
    }
    let mut table = Table::new(&[
        "NODE", "GPU", "MODEL", "CC", "MEMORY", "MODE", "USED/CAP", "FREE", "HEALTH", "SESSIONS",
    ]);
    table.keep_whole(&[1, 3, 4, 5, 6, 7]);
    for node in nodes {
        let node_name = match (node.online, node.drain.is_some()) {
            (true, false) => node.name.to_string(),
            (false, false) => format!("{} (offline)", node.name),
            (true, true) => format!("{} (drained)", node.name),
            (false, true) => format!("{} (offline, drained)", node.name),
        };
        if node.gpus.is_empty() {
            table.row([node_name.clone(), "(no GPUs)".to_owned()]);
        }
        for gpu in &node.gpus {
            let sessions = gpu
                .sessions
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(",");
            table.row([
                node_name.clone(),
                gpu.info.uuid.to_string(),
                gpu.info.model.clone(),
                gpu.info.capability.to_string(),
                gpu.info.memory.to_string(),
                gpu.mode.to_string(),
                // In MIG mode its places are its devices.
                format!(
                    "{}/{}",
                    gpu.used,
                    if gpu.mode.mig_layout().is_some() {
                        u32::try_from(gpu.info.mig_devices.len()).unwrap_or(u32::MAX)
                    } else {
                        gpu.mode.capacity()
                    }
                ),
                gpu.free.to_string(),
                health(node, gpu),
                if sessions.is_empty() {
                    "-".to_owned()
                } else {
                    sessions
                },
            ]);
            // A GPU in MIG mode: its devices under it, one row each.
            if gpu.mode.mig_layout().is_some() {
                for device in &gpu.info.mig_devices {
                    let session = gpu.mig_sessions.get(&device.uuid);
                    table.row([
                        String::new(),
                        format!("└ {}", device.uuid),
                        format!("MIG {}", device.profile),
                        gpu.info.capability.to_string(),
                        device.memory.to_string(),
                        "mig device".to_owned(),
                        format!("{}/1", u8::from(session.is_some())),
                        {
                            let in_service = node.online
                                && node.drain.is_none()
                                && gpu.drain.is_none()
                                && gpu.info.health.is_healthy();
                            if session.is_some() || !in_service {
                                "0"
                            } else {
                                "1"
                            }
                            .to_owned()
                        },
                        health(node, gpu),
                        session.map_or("-".to_owned(), |s| s.to_string()),
                    ]);
                }
            }
        }
    }
    table.render(width, "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{DateTime, Utc};
    use ongrid_core::gpu::Drain;
    use ongrid_core::{
        ComputeCapability, GpuInfo, GpuMode, GpuUuid, MemorySize, NodeName, SessionName,
    };

    const UUID_A: &str = "GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f";
    const UUID_B: &str = "GPU-11111111-2222-3333-4444-555555555502";

    fn at(secs: i64) -> DateTime<Utc> {
        // 2026-11-21 10:00:00Z
        DateTime::from_timestamp(1_795_255_200 + secs, 0).unwrap()
    }

    fn gpu(uuid: &str, mode: GpuMode, used: u32, health: GpuHealth) -> GpuView {
        GpuView {
            info: GpuInfo {
                uuid: GpuUuid::parse(uuid).unwrap(),
                model: "NVIDIA A100-SXM4-40GB".into(),
                capability: ComputeCapability::new(8, 0),
                memory: MemorySize::from_mib(40_960),
                pci_bus_id: None,
                driver_version: None,
                mig_enabled: false,
                health,
                utilization_percent: None,
                mig_devices: Vec::new(),
                mig_waiting: None,
            },
            node: NodeName::parse("node1").unwrap(),
            mode,
            used,
            free: mode.capacity() - used,
            sessions: (0..used)
                .map(|i| SessionName::parse(&format!("s{i}")).unwrap())
                .collect(),
            drain: None,
            mig_sessions: Default::default(),
        }
    }

    fn drain(reason: &str) -> Option<Drain> {
        Some(Drain {
            reason: reason.into(),
            since: at(0),
            by: "alice".into(),
        })
    }

    #[test]
    fn gpu_table_marks_offline_nodes_and_failed_gpus() {
        let offline_gpu = GpuView {
            node: NodeName::parse("node2").unwrap(),
            free: 0,
            ..gpu(UUID_B, GpuMode::Exclusive, 0, GpuHealth::Healthy)
        };
        let nodes = [
            NodeView {
                name: NodeName::parse("node1").unwrap(),
                online: true,
                last_seen: at(0),
                gpu_backend: "simulated".into(),
                gpus: vec![
                    gpu(UUID_A, GpuMode::Exclusive, 1, GpuHealth::Healthy),
                    gpu(
                        UUID_B,
                        GpuMode::Shared { max_sessions: 4 },
                        2,
                        GpuHealth::Failed("fell off the bus".into()),
                    ),
                ],
                agent_version: "0.1.0".into(),
                drain: None,
                sessions: 0,
                jobs: 0,
            },
            NodeView {
                name: NodeName::parse("node2").unwrap(),
                online: false,
                last_seen: at(60),
                gpu_backend: "nvidia-smi".into(),
                gpus: vec![offline_gpu],
                agent_version: "0.1.0".into(),
                drain: None,
                sessions: 0,
                jobs: 0,
            },
            NodeView {
                name: NodeName::parse("node3").unwrap(),
                online: true,
                last_seen: at(60),
                gpu_backend: "nvidia-smi".into(),
                gpus: vec![],
                agent_version: "0.1.0".into(),
                drain: None,
                sessions: 0,
                jobs: 0,
            },
            NodeView {
                name: NodeName::parse("node4").unwrap(),
                online: true,
                last_seen: at(60),
                gpu_backend: "nvidia-smi".into(),
                gpus: vec![
                    GpuView {
                        node: NodeName::parse("node4").unwrap(),
                        drain: drain("new fan"),
                        free: 0,
                        ..gpu(UUID_A, GpuMode::Exclusive, 0, GpuHealth::Healthy)
                    },
                    GpuView {
                        node: NodeName::parse("node4").unwrap(),
                        free: 0,
                        ..gpu(UUID_B, GpuMode::Exclusive, 1, GpuHealth::Healthy)
                    },
                ],
                agent_version: "0.1.0".into(),
                drain: drain("rack move"),
                sessions: 1,
                jobs: 0,
            },
        ];
        let expected = [
            "NODE             GPU                                       MODEL                  CC   MEMORY    MODE       USED/CAP  FREE  HEALTH                                   SESSIONS",
            "node1            GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f  NVIDIA A100-SXM4-40GB  8.0  40.0 GiB  exclusive  1/1       0     ok                                       s0",
            "node1            GPU-11111111-2222-3333-4444-555555555502  NVIDIA A100-SXM4-40GB  8.0  40.0 GiB  shared:4   2/4       2     FAILED: fell off the bus                 s0,s1",
            "node2 (offline)  GPU-11111111-2222-3333-4444-555555555502  NVIDIA A100-SXM4-40GB  8.0  40.0 GiB  exclusive  0/1       0     node offline since 2026-11-21 10:01:00Z  -",
            "node3            (no GPUs)",
            "node4 (drained)  GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f  NVIDIA A100-SXM4-40GB  8.0  40.0 GiB  exclusive  0/1       0     ok, DRAINED: new fan                     -",
            "node4 (drained)  GPU-11111111-2222-3333-4444-555555555502  NVIDIA A100-SXM4-40GB  8.0  40.0 GiB  exclusive  1/1       0     ok, node DRAINED: rack move              s0",
        ];
        assert_eq!(render(&nodes, None), expected.join("\n") + "\n");
        assert_eq!(
            render(&[], None),
            "no nodes: no node agent has registered with the manager yet\n"
        );
    }

    #[test]
    fn a_narrow_terminal_wraps_the_free_text_not_the_uuids() {
        let node = NodeView {
            name: NodeName::parse("node1").unwrap(),
            online: true,
            last_seen: at(0),
            gpu_backend: "simulated".into(),
            gpus: vec![gpu(
                UUID_A,
                GpuMode::Exclusive,
                1,
                GpuHealth::Failed("fell off the bus after an Xid 79 error".into()),
            )],
            agent_version: "0.1.0".into(),
            drain: None,
            sessions: 0,
            jobs: 0,
        };
        let text = render(std::slice::from_ref(&node), Some(100));
        assert!(text.lines().all(|l| l.chars().count() <= 100), "{text}");
        assert!(text.contains(UUID_A), "{text}");
        assert!(text.lines().count() > 2, "the health wraps: {text}");
        assert_eq!(render(std::slice::from_ref(&node), None).lines().count(), 2);
    }
}
