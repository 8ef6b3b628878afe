//! Making each GPU's MIG state match the admin's mode: the layout of a GPU in `mig` mode
//! (`DesiredState.mig_layouts`), and MIG mode off on a GPU set back to `exclusive` or
//! `shared:N` (`DesiredState.mig_off`).
//!
//! A change is made through the [`GpuBackend`] ([`GpuBackend::apply_mig`],
//! [`GpuBackend::leave_mig`]) only when nothing uses the GPU: no session or job of the desired
//! state and no container on the node holds the GPU or one of its MIG devices. Until then the
//! GPU waits to drain: said once in the log, and in every report (`GpuInfo::mig_waiting`), so
//! `devctl admin node ls` shows it. Meanwhile the manager places nothing new there: it offers
//! only reported devices, and no whole GPU while MIG mode is on. A change that fails (the driver
//! refuses it, leaves it half made, or needs a GPU reset first) marks the GPU failed with the
//! backend's message in every report, so the manager drains it; a different mode from the
//! admin is tried again.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ongrid_core::{GpuHealth, GpuId, GpuInfo, GpuUuid, MigChange, MigLayout};
use tracing::{info, warn};

use super::GpuBackend;

/// Whether `gpu` has MIG mode on and exactly the devices of `layout` (in any order).
pub fn matches(gpu: &GpuInfo, layout: MigLayout) -> bool {
    gpu.mig_enabled && layout.is_made_by(&gpu.mig_devices)
}

/// Whether any of `ids` is `gpu` or one of its MIG devices.
pub fn uses(gpu: &GpuInfo, ids: &[GpuId]) -> bool {
    ids.iter().any(|id| match id {
        GpuId::Gpu(uuid) => uuid == &gpu.uuid,
        GpuId::Mig(mig) => gpu.mig_devices.iter().any(|d| &d.uuid == mig),
    })
}

/// What the admin's modes ask of the node's GPUs' MIG state.
#[derive(Debug, Clone, Copy)]
pub struct MigWanted<'a> {
    /// The layout of each GPU in `mig` mode.
    pub layouts: &'a BTreeMap<GpuUuid, MigLayout>,
    /// GPUs in `exclusive` or `shared:N` mode that must not be in MIG mode.
    pub off: &'a BTreeSet<GpuUuid>,
}

impl MigWanted<'_> {
    /// The change `gpu` needs, if any.
    fn change_for(&self, gpu: &GpuInfo) -> Option<MigChange> {
        if let Some(&layout) = self.layouts.get(&gpu.uuid) {
            return (!matches(gpu, layout)).then_some(MigChange::Layout(layout));
        }
        (self.off.contains(&gpu.uuid) && (gpu.mig_enabled || !gpu.mig_devices.is_empty()))
            .then_some(MigChange::Off)
    }

    fn wants(&self, gpu: &GpuUuid, change: MigChange) -> bool {
        match change {
            MigChange::Layout(layout) => self.layouts.get(gpu) == Some(&layout),
            MigChange::Off => self.off.contains(gpu),
        }
    }
}

/// The agent's MIG work: which changes failed, which GPUs wait to drain for one.
#[derive(Debug, Default)]
pub struct MigLayouts {
    failed: HashMap<GpuUuid, (MigChange, String)>,
    waiting: HashMap<GpuUuid, MigChange>,
}

impl MigLayouts {
    /// Marks the GPUs whose change failed as failed, with the backend's message, and those
    /// waiting to drain with the change they wait for.
    pub fn mark(&self, gpus: &mut [GpuInfo]) {
        for gpu in gpus {
            gpu.mig_waiting = self.waiting.get(&gpu.uuid).copied();
            if let Some((change, problem)) = self.failed.get(&gpu.uuid) {
                if gpu.health.is_healthy() {
                    let what = match change {
                        MigChange::Layout(layout) => {
                            format!("MIG layout {layout} could not be made")
                        }
                        MigChange::Off => "MIG mode could not be turned off".to_owned(),
                    };
                    gpu.health = GpuHealth::Failed(format!(
                        "{what}: {problem}; the GPU is out of service until an admin sets a mode \
                         that works (devctl admin gpu mode) and undrains it"
                    ));
                }
            }
        }
    }

    /// The backend's message for the change of `gpu` that failed, while it stands.
    pub fn failure(&self, gpu: &GpuUuid) -> Option<&str> {
        self.failed.get(gpu).map(|(_, problem)| problem.as_str())
    }

    /// Makes every change `wanted` asks that `inventory` does not show yet, on GPUs nothing
    /// uses (`in_use`: the GPU and MIG device ids held by sessions, jobs and containers).
    /// Returns whether a change was made or tried, or a GPU began or stopped waiting, so the
    /// caller reports it at once.
    pub async fn apply(
        &mut self,
        backend: &dyn GpuBackend,
        wanted: MigWanted<'_>,
        inventory: &[GpuInfo],
        in_use: &[GpuId],
    ) -> bool {
        self.failed
            .retain(|gpu, (change, _)| wanted.wants(gpu, *change));
        let mut changed = false;
        let mut still_waiting = HashMap::new();
        for gpu in inventory {
            let Some(change) = wanted.change_for(gpu) else {
                continue;
            };
            let uuid = &gpu.uuid;
            if self.failed.contains_key(uuid) || !gpu.health.is_healthy() {
                continue;
            }
            if uses(gpu, in_use) {
                if self.waiting.get(uuid) != Some(&change) {
                    info!(gpu = %uuid, %change,
                          "GPU waits to drain: its MIG change is made once no session or job uses it.");
                }
                still_waiting.insert(uuid.clone(), change);
                continue;
            }
            let done = match change {
                MigChange::Layout(layout) => backend.apply_mig(gpu, layout).await,
                MigChange::Off => backend.leave_mig(gpu).await,
            };
            changed = true;
            match done {
                Ok(()) => info!(gpu = %uuid, %change, "MIG change made."),
                Err(e) => {
                    warn!(gpu = %uuid, %change, error = %e,
                          "MIG change failed; the GPU is reported failed until the admin changes its mode.");
                    let problem = match e {
                        super::GpuError::Mig { problem, .. }
                        | super::GpuError::MigOff { problem, .. } => problem,
                        other => other.to_string(),
                    };
                    self.failed.insert(uuid.clone(), (change, problem));
                }
            }
        }
        changed |= still_waiting != self.waiting;
        self.waiting = still_waiting;
        changed
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::gpu::SimulatedBackend;

    const GPU: &str = "GPU-11111111-2222-3333-4444-555555555501";

    fn file(extra: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        write!(
            f,
            "[[gpu]]\nuuid = \"{GPU}\"\nmodel = \"NVIDIA A100-SXM4-80GB\"\ncapability = \"8.0\"\n\
             memory = \"81920MiB\"\n{extra}"
        )
        .unwrap();
        f
    }

    fn layouts(text: &str) -> BTreeMap<GpuUuid, MigLayout> {
        BTreeMap::from([(GpuUuid::parse(GPU).unwrap(), text.parse().unwrap())])
    }

    static NONE_OFF: BTreeSet<GpuUuid> = BTreeSet::new();

    fn layouts_only(layouts: &BTreeMap<GpuUuid, MigLayout>) -> MigWanted<'_> {
        MigWanted {
            layouts,
            off: &NONE_OFF,
        }
    }

    #[tokio::test]
    async fn a_layout_is_made_only_once_nothing_uses_the_gpu() {
        let f = file("");
        let backend = SimulatedBackend::new(f.path().to_owned());
        let mut mig = MigLayouts::default();
        let wanted = layouts("3g.40gb*1+2g.20gb*2");
        let gpus = backend.discover_gpus().await.unwrap();
        let session_on_it = [GpuId::parse(GPU).unwrap()];
        // Waiting is news (reported at once), but nothing is made.
        assert!(
            mig.apply(&backend, layouts_only(&wanted), &gpus, &session_on_it)
                .await
        );
        let gpus = backend.discover_gpus().await.unwrap();
        assert!(
            gpus[0].mig_devices.is_empty(),
            "made while a session used the GPU"
        );

        assert!(mig.apply(&backend, layouts_only(&wanted), &gpus, &[]).await);
        let gpus = backend.discover_gpus().await.unwrap();
        assert!(gpus[0].mig_enabled);
        let profiles: Vec<String> = gpus[0]
            .mig_devices
            .iter()
            .map(|d| d.profile.to_string())
            .collect();
        assert_eq!(profiles, ["3g.40gb", "2g.20gb", "2g.20gb"]);
        assert!(gpus[0].mig_devices.iter().all(|d| d.parent == gpus[0].uuid));
        assert!(matches(&gpus[0], wanted[&gpus[0].uuid]));
        // Matching now: nothing more to do.
        assert!(!mig.apply(&backend, layouts_only(&wanted), &gpus, &[]).await);

        // A new layout waits while a session holds one of the devices.
        let on_slice = [GpuId::Mig(gpus[0].mig_devices[1].uuid.clone())];
        let seven = layouts("1g.10gb*7");
        assert!(
            mig.apply(&backend, layouts_only(&seven), &gpus, &on_slice)
                .await
        );
        assert_eq!(
            backend.discover_gpus().await.unwrap()[0].mig_devices.len(),
            3,
            "made while a session used a device"
        );
        assert!(mig.apply(&backend, layouts_only(&seven), &gpus, &[]).await);
        let gpus = backend.discover_gpus().await.unwrap();
        assert_eq!(gpus[0].mig_devices.len(), 7);
    }

    #[tokio::test]
    async fn a_failed_layout_marks_the_gpu_failed_until_the_layout_changes() {
        let f = file("mig_fail = \"In use by another client\"\n");
        let backend = SimulatedBackend::new(f.path().to_owned());
        let mut mig = MigLayouts::default();
        let wanted = layouts("1g.10gb*7");
        let gpus = backend.discover_gpus().await.unwrap();
        assert!(mig.apply(&backend, layouts_only(&wanted), &gpus, &[]).await);
        let mut gpus = backend.discover_gpus().await.unwrap();
        mig.mark(&mut gpus);
        let GpuHealth::Failed(reason) = &gpus[0].health else {
            panic!("{:?}", gpus[0].health);
        };
        assert!(
            reason.starts_with("MIG layout 1g.10gb*7 could not be made: In use by another client"),
            "{reason}"
        );
        // Not retried while the admin keeps that layout.
        assert!(!mig.apply(&backend, layouts_only(&wanted), &gpus, &[]).await);
        // Another layout clears the failure and is tried.
        let mut gpus = backend.discover_gpus().await.unwrap();
        assert!(
            mig.apply(&backend, layouts_only(&layouts("7g.80gb*1")), &gpus, &[])
                .await
        );
        mig.failed.clear();
        mig.mark(&mut gpus);
        assert!(gpus[0].health.is_healthy());
    }

    #[tokio::test]
    async fn a_layout_the_model_lacks_fails_with_the_reason() {
        let f = file("");
        let backend = SimulatedBackend::new(f.path().to_owned());
        let mut mig = MigLayouts::default();
        let gpus = backend.discover_gpus().await.unwrap();
        assert!(
            mig.apply(&backend, layouts_only(&layouts("1g.5gb*7")), &gpus, &[])
                .await
        );
        let mut gpus = backend.discover_gpus().await.unwrap();
        mig.mark(&mut gpus);
        assert!(
            matches!(&gpus[0].health, GpuHealth::Failed(r) if r.contains("no MIG profile 1g.5gb"))
        );
    }

    #[tokio::test]
    async fn leaving_mig_mode_waits_for_the_gpu_to_empty_and_leaves_a_whole_gpu() {
        let f = file("");
        let backend = SimulatedBackend::new(f.path().to_owned());
        let mut mig = MigLayouts::default();
        let gpus = backend.discover_gpus().await.unwrap();
        assert!(
            mig.apply(&backend, layouts_only(&layouts("1g.10gb*7")), &gpus, &[])
                .await
        );
        let gpus = backend.discover_gpus().await.unwrap();
        assert_eq!(gpus[0].mig_devices.len(), 7);

        // The admin sets it exclusive while a job holds one of its devices: it waits, says so.
        let off = BTreeSet::from([GpuUuid::parse(GPU).unwrap()]);
        let none = BTreeMap::new();
        let wanted = MigWanted {
            layouts: &none,
            off: &off,
        };
        let job_on_slice = [GpuId::Mig(gpus[0].mig_devices[3].uuid.clone())];
        assert!(mig.apply(&backend, wanted, &gpus, &job_on_slice).await);
        let mut gpus = backend.discover_gpus().await.unwrap();
        assert_eq!(
            gpus[0].mig_devices.len(),
            7,
            "left MIG mode while a job used it"
        );
        mig.mark(&mut gpus);
        assert_eq!(gpus[0].mig_waiting, Some(MigChange::Off));
        assert!(gpus[0].health.is_healthy());
        // Still waiting: nothing new to report.
        assert!(!mig.apply(&backend, wanted, &gpus, &job_on_slice).await);

        // Empty: MIG mode off, no devices, a whole GPU, nothing waiting.
        assert!(mig.apply(&backend, wanted, &gpus, &[]).await);
        let mut gpus = backend.discover_gpus().await.unwrap();
        mig.mark(&mut gpus);
        assert!(!gpus[0].mig_enabled);
        assert!(gpus[0].mig_devices.is_empty());
        assert_eq!(gpus[0].mig_waiting, None);
        assert!(gpus[0].health.is_healthy());
        // Whole already: nothing to do.
        assert!(!mig.apply(&backend, wanted, &gpus, &[]).await);
    }

    #[tokio::test]
    async fn a_failed_exit_from_mig_mode_marks_the_gpu_failed_with_the_reason() {
        let f = file("");
        let backend = SimulatedBackend::new(f.path().to_owned());
        let mut mig = MigLayouts::default();
        let gpus = backend.discover_gpus().await.unwrap();
        assert!(
            mig.apply(&backend, layouts_only(&layouts("7g.80gb*1")), &gpus, &[])
                .await
        );
        // The driver now refuses MIG changes on it.
        let mut text = std::fs::read_to_string(f.path()).unwrap();
        text.push_str("mig_fail = \"In use by another client\"\n");
        std::fs::write(f.path(), text).unwrap();
        let gpus = backend.discover_gpus().await.unwrap();
        let off = BTreeSet::from([GpuUuid::parse(GPU).unwrap()]);
        let none = BTreeMap::new();
        let wanted = MigWanted {
            layouts: &none,
            off: &off,
        };
        assert!(mig.apply(&backend, wanted, &gpus, &[]).await);
        let mut gpus = backend.discover_gpus().await.unwrap();
        mig.mark(&mut gpus);
        let GpuHealth::Failed(reason) = &gpus[0].health else {
            panic!("{:?}", gpus[0].health);
        };
        assert_eq!(
            reason,
            "MIG mode could not be turned off: In use by another client (simulated: mig_fail); \
             the GPU is out of service until an admin sets a mode that works (devctl admin gpu \
             mode) and undrains it"
        );
        assert!(gpus[0].mig_enabled, "the devices stay as they were");
        // Not retried while the admin keeps that mode; a layout again clears the failure.
        assert!(!mig.apply(&backend, wanted, &gpus, &[]).await);
        assert!(
            !mig.apply(&backend, layouts_only(&layouts("7g.80gb*1")), &gpus, &[])
                .await
        );
        let mut gpus = backend.discover_gpus().await.unwrap();
        mig.mark(&mut gpus);
        assert!(gpus[0].health.is_healthy());
    }
}
