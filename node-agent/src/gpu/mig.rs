//! Making each GPU's MIG devices match the admin's layout (`DesiredState.mig_layouts`).
//!
//! A layout is applied through [`GpuBackend::apply_mig`] only when nothing uses the GPU: no
//! session or job of the desired state and no container on the node holds the GPU or one of its
//! MIG devices. Until then the GPU waits to drain (said once in the log; the manager places
//! nothing new on a GPU whose devices do not match its layout, since it offers only reported
//! devices). A layout that fails (the driver refuses it, or leaves it half made) marks the GPU
//! failed with the backend's message in every report, so the manager drains it; a different
//! layout from the admin is tried again.

use std::collections::{BTreeMap, HashMap, HashSet};

use ongrid_core::{GpuHealth, GpuId, GpuInfo, GpuUuid, MigLayout, MigProfile};
use tracing::{info, warn};

use super::GpuBackend;

/// Whether `gpu` has MIG mode on and exactly the devices of `layout` (in any order).
pub fn matches(gpu: &GpuInfo, layout: MigLayout) -> bool {
    let mut have: Vec<MigProfile> = gpu.mig_devices.iter().map(|d| d.profile).collect();
    let mut want = layout.instances();
    have.sort();
    want.sort();
    gpu.mig_enabled && have == want
}

/// Whether any of `ids` is `gpu` or one of its MIG devices.
pub fn uses(gpu: &GpuInfo, ids: &[GpuId]) -> bool {
    ids.iter().any(|id| match id {
        GpuId::Gpu(uuid) => uuid == &gpu.uuid,
        GpuId::Mig(mig) => gpu.mig_devices.iter().any(|d| &d.uuid == mig),
    })
}

/// The agent's MIG work: which layouts failed, which GPUs wait to drain.
#[derive(Debug, Default)]
pub struct MigLayouts {
    failed: HashMap<GpuUuid, (MigLayout, String)>,
    waiting: HashSet<GpuUuid>,
}

impl MigLayouts {
    /// Marks the GPUs whose layout failed as failed, with the backend's message.
    pub fn mark_failures(&self, gpus: &mut [GpuInfo]) {
        for gpu in gpus {
            if let Some((layout, problem)) = self.failed.get(&gpu.uuid) {
                if gpu.health.is_healthy() {
                    gpu.health = GpuHealth::Failed(format!(
                        "MIG layout {layout} could not be made: {problem}; the GPU is out of \
                         service until an admin sets a layout that works (devctl admin gpu mode) \
                         and undrains it"
                    ));
                }
            }
        }
    }

    /// Applies every layout of `layouts` that `inventory` does not show yet, on GPUs nothing
    /// uses (`in_use`: the GPU and MIG device ids held by sessions, jobs and containers).
    /// Returns whether a layout was made, so the caller reports the new devices at once.
    pub async fn apply(
        &mut self,
        backend: &dyn GpuBackend,
        layouts: &BTreeMap<GpuUuid, MigLayout>,
        inventory: &[GpuInfo],
        in_use: &[GpuId],
    ) -> bool {
        self.failed
            .retain(|gpu, (layout, _)| layouts.get(gpu) == Some(layout));
        self.waiting.retain(|gpu| layouts.contains_key(gpu));
        let mut made = false;
        for (uuid, &layout) in layouts {
            let Some(gpu) = inventory.iter().find(|g| &g.uuid == uuid) else {
                continue;
            };
            if matches(gpu, layout) || self.failed.contains_key(uuid) || !gpu.health.is_healthy() {
                continue;
            }
            if uses(gpu, in_use) {
                if self.waiting.insert(uuid.clone()) {
                    info!(gpu = %uuid, %layout,
                          "GPU waits to drain: its MIG layout is made once no session or job uses it.");
                }
                continue;
            }
            self.waiting.remove(uuid);
            match backend.apply_mig(gpu, layout).await {
                Ok(()) => {
                    info!(gpu = %uuid, %layout, "MIG layout made.");
                    made = true;
                }
                Err(e) => {
                    warn!(gpu = %uuid, %layout, error = %e,
                          "MIG layout failed; the GPU is reported failed until the admin changes its mode.");
                    let problem = match e {
                        super::GpuError::Mig { problem, .. } => problem,
                        other => other.to_string(),
                    };
                    self.failed.insert(uuid.clone(), (layout, problem));
                    made = true;
                }
            }
        }
        made
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

    #[tokio::test]
    async fn a_layout_is_made_only_once_nothing_uses_the_gpu() {
        let f = file("");
        let backend = SimulatedBackend::new(f.path().to_owned());
        let mut mig = MigLayouts::default();
        let wanted = layouts("3g.40gb*1+2g.20gb*2");
        let gpus = backend.discover_gpus().await.unwrap();
        let session_on_it = [GpuId::parse(GPU).unwrap()];
        assert!(!mig.apply(&backend, &wanted, &gpus, &session_on_it).await);
        let gpus = backend.discover_gpus().await.unwrap();
        assert!(
            gpus[0].mig_devices.is_empty(),
            "made while a session used the GPU"
        );

        assert!(mig.apply(&backend, &wanted, &gpus, &[]).await);
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
        assert!(!mig.apply(&backend, &wanted, &gpus, &[]).await);

        // A new layout waits while a session holds one of the devices.
        let on_slice = [GpuId::Mig(gpus[0].mig_devices[1].uuid.clone())];
        let seven = layouts("1g.10gb*7");
        assert!(!mig.apply(&backend, &seven, &gpus, &on_slice).await);
        assert!(mig.apply(&backend, &seven, &gpus, &[]).await);
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
        assert!(mig.apply(&backend, &wanted, &gpus, &[]).await);
        let mut gpus = backend.discover_gpus().await.unwrap();
        mig.mark_failures(&mut gpus);
        let GpuHealth::Failed(reason) = &gpus[0].health else {
            panic!("{:?}", gpus[0].health);
        };
        assert!(
            reason.starts_with("MIG layout 1g.10gb*7 could not be made: In use by another client"),
            "{reason}"
        );
        // Not retried while the admin keeps that layout.
        assert!(!mig.apply(&backend, &wanted, &gpus, &[]).await);
        // Another layout clears the failure and is tried.
        let mut gpus = backend.discover_gpus().await.unwrap();
        assert!(mig.apply(&backend, &layouts("7g.80gb*1"), &gpus, &[]).await);
        mig.failed.clear();
        mig.mark_failures(&mut gpus);
        assert!(gpus[0].health.is_healthy());
    }

    #[tokio::test]
    async fn a_layout_the_model_lacks_fails_with_the_reason() {
        let f = file("");
        let backend = SimulatedBackend::new(f.path().to_owned());
        let mut mig = MigLayouts::default();
        let gpus = backend.discover_gpus().await.unwrap();
        assert!(mig.apply(&backend, &layouts("1g.5gb*7"), &gpus, &[]).await);
        let mut gpus = backend.discover_gpus().await.unwrap();
        mig.mark_failures(&mut gpus);
        assert!(
            matches!(&gpus[0].health, GpuHealth::Failed(r) if r.contains("no MIG profile 1g.5gb"))
        );
    }
}
