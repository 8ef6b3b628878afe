//! `devctl admin gpu mode GPU exclusive|shared:N` (`PUT /v1/gpus/{uuid}/mode`): how many
//! sessions may share a GPU. `devctl admin gpu drain GPU [--reason TEXT]`
//! (`POST /v1/gpus/{uuid}/drain`): nothing new is placed on it, what runs there keeps running;
//! `devctl admin gpu undrain GPU` (`DELETE /v1/gpus/{uuid}/drain`): back in service.
//! `devctl admin gpu owner GPU GROUP|--clear` (`PUT|DELETE /v1/gpus/{uuid}/owner`): the owner
//! group whose work goes first on it.

use clap::{Args, Subcommand};
use ongrid_core::api::{DrainRequest, GpuView, SetGpuMode};
use ongrid_core::{GpuMode, GpuUuid};

use crate::client::Client;
use crate::terminal::{JsonArgs, Terminal};

#[derive(Debug, Subcommand)]
pub enum AdminGpuCommand {
    /// Set how sessions may use a GPU: exclusive (one session) or shared:N (up to N)
    Mode(GpuModeArgs),
    /// Place nothing new on a GPU; sessions and jobs on it keep running
    Drain(GpuDrainArgs),
    /// Put a drained GPU back in service
    Undrain(GpuArgs),
    /// Give a GPU an owner group, whose work goes first there (others' jobs run there only as
    /// backfill, others' sessions not at all unless the site allows it); --clear takes it away
    Owner(GpuOwnerArgs),
}

#[derive(Debug, Clone, Args)]
pub struct GpuOwnerArgs {
    /// The GPU's UUID, as devctl gpus shows it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
    pub gpu: GpuUuid,
    /// The owner group (an accounting group, as devctl share lists them)
    #[arg(required_unless_present = "clear", conflicts_with = "clear")]
    pub group: Option<String>,
    /// Take the owner away (the GPU's node's owner, if any, applies again)
    #[arg(long)]
    pub clear: bool,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct GpuDrainArgs {
    /// The GPU's UUID, as devctl gpus shows it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
    pub gpu: GpuUuid,
    /// Why, for the people whose work is there (default: maintenance)
    #[arg(long)]
    pub reason: Option<String>,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct GpuArgs {
    /// The GPU's UUID, as devctl gpus shows it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
    pub gpu: GpuUuid,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct GpuModeArgs {
    /// The GPU's UUID, as devctl gpus --json shows it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
    pub gpu: GpuUuid,
    /// exclusive, shared:N with N from 2 to 64, or mig:LAYOUT (MIG devices, e.g. mig:1g.10gb*7
    /// or mig:3g.40gb*1+2g.20gb*2, checked against the GPU model's profiles)
    #[arg(value_name = "exclusive|shared:N|mig:LAYOUT")]
    pub mode: GpuMode,
    #[command(flatten)]
    pub output: JsonArgs,
}

pub async fn run(
    command: AdminGpuCommand,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        AdminGpuCommand::Mode(GpuModeArgs { gpu, mode, output }) => {
            let view: GpuView = client
                .put(&format!("v1/gpus/{gpu}/mode"))
                .json(&SetGpuMode { mode })
                .send()
                .await?;
            term.show(output.json, &view, render_mode)
        }
        AdminGpuCommand::Drain(GpuDrainArgs {
            gpu,
            reason,
            output,
        }) => {
            let view: GpuView = client
                .post(&format!("v1/gpus/{gpu}/drain"))
                .json(&DrainRequest { reason })
                .send()
                .await?;
            term.show(output.json, &view, render_drain)
        }
        AdminGpuCommand::Owner(GpuOwnerArgs {
            gpu,
            group,
            clear: _,
            output,
        }) => {
            let path = format!("v1/gpus/{gpu}/owner");
            let view: ongrid_core::reservation::OwnerView = match group {
                Some(group) => {
                    let body = ongrid_core::reservation::SetOwner { group };
                    client.put(&path).json(&body).send().await?
                }
                None => client.delete(&path).send().await?,
            };
            term.show(output.json, &view, super::reservation::render_owner)
        }
        AdminGpuCommand::Undrain(GpuArgs { gpu, output }) => {
            let view: GpuView = client
                .delete(&format!("v1/gpus/{gpu}/drain"))
                .send()
                .await?;
            term.show(output.json, &view, render_drain)
        }
    }
}

/// `devctl admin gpu drain|undrain`: the GPU after the change.
pub fn render_drain(gpu: &GpuView) -> String {
    let running = match gpu.used {
        0 => "nothing runs on it".to_owned(),
        1 => "1 session or job keeps running on it".to_owned(),
        n => format!("{n} sessions or jobs keep running on it"),
    };
    match &gpu.drain {
        Some(drain) => format!(
            "GPU {} on {} {}; {running}\n",
            gpu.info.uuid,
            gpu.node,
            drain.sentence()
        ),
        None => format!("GPU {} on {} is back in service\n", gpu.info.uuid, gpu.node),
    }
}

/// `devctl admin gpu mode`: the GPU after the change.
pub fn render_mode(gpu: &GpuView) -> String {
    if let Some(layout) = gpu.mode.mig_layout() {
        return format!(
            "GPU {} on {} is now {}: {} MIG devices, made by its node's agent once no session \
             uses the GPU (devctl gpus shows them)\n",
            gpu.info.uuid,
            gpu.node,
            gpu.mode,
            layout.instances().len()
        );
    }
    if gpu.info.mig_enabled {
        return format!(
            "GPU {} on {} is now {}: its node's agent destroys its {} MIG devices and turns MIG \
             mode off once no session or job uses them; nothing is placed on it until then \
             (devctl admin node ls says while it waits)\n",
            gpu.info.uuid,
            gpu.node,
            gpu.mode,
            gpu.info.mig_devices.len()
        );
    }
    format!(
        "GPU {} on {} is now {} ({} of {} in use)\n",
        gpu.info.uuid,
        gpu.node,
        gpu.mode,
        gpu.used,
        gpu.mode.capacity()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ongrid_core::{ComputeCapability, GpuHealth, GpuInfo, MemorySize, NodeName};

    #[test]
    fn a_mode_change_says_the_new_use() {
        let view = GpuView {
            info: GpuInfo {
                uuid: GpuUuid::parse("GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f").unwrap(),
                model: "NVIDIA A100-SXM4-40GB".into(),
                capability: ComputeCapability::new(8, 0),
                memory: MemorySize::from_mib(40_960),
                pci_bus_id: None,
                driver_version: None,
                mig_enabled: false,
                health: GpuHealth::Healthy,
                utilization_percent: None,
                mig_devices: Vec::new(),
                mig_waiting: None,
            },
            node: NodeName::parse("node1").unwrap(),
            mode: GpuMode::Shared { max_sessions: 4 },
            used: 1,
            free: 3,
            sessions: vec![],
            drain: None,
            mig_sessions: Default::default(),
        };
        assert_eq!(
            render_mode(&view),
            "GPU GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f on node1 is now shared:4 (1 of 4 in use)\n"
        );
        // Still in MIG mode: its agent leaves it first.
        let mut leaving = view.clone();
        leaving.info.mig_enabled = true;
        assert_eq!(
            render_mode(&leaving),
            "GPU GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f on node1 is now shared:4: its node's \
             agent destroys its 0 MIG devices and turns MIG mode off once no session or job uses \
             them; nothing is placed on it until then (devctl admin node ls says while it waits)\n"
        );
    }
}
