//! Frozen images removed with `devctl image rm` leave the node: the manager lists their Docker
//! names in `DesiredState::removed_images` (those removed within its retention window), and
//! every sync the agent removes each tag it still has, through
//! [`ContainerRuntime::remove_tag`] (forced: a container started from the image keeps running,
//! but nothing new starts from the tag).
//!
//! Only names of frozen images, `ongrid/<login>/<name>:<version>`, are ever touched, whatever
//! the list holds: the site's images and the held-session images (`ongrid-held/...`) are not
//! the manager's to remove this way.

use std::collections::HashSet;
use std::sync::Arc;

use ongrid_core::image::ImageReference;
use ongrid_core::UserName;
use tracing::{debug, info, warn};

use crate::runtime::{error_chain, ContainerRuntime};

/// Whether `name` is a frozen image's Docker name, `ongrid/<login>/<name>:<version>`.
pub fn is_frozen_image(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("ongrid/") else {
        return false;
    };
    let Some((login, reference)) = rest.split_once('/') else {
        return false;
    };
    UserName::parse(login).is_ok() && ImageReference::parse(reference).is_ok()
}

/// Removes the tags of removed frozen images; remembers which failures it has logged.
pub struct RemovedImages {
    runtime: Arc<dyn ContainerRuntime>,
    /// Names whose removal failed and was logged (a repeat is logged at debug).
    failing: HashSet<String>,
}

impl RemovedImages {
    pub fn new(runtime: Arc<dyn ContainerRuntime>) -> Self {
        Self {
            runtime,
            failing: HashSet::new(),
        }
    }

    /// One pass over the manager's list: every frozen image's tag on it that is on the node is
    /// removed; a failure is retried on the next pass.
    pub async fn remove(&mut self, removed: &[String]) {
        self.failing.retain(|name| removed.contains(name));
        for name in removed {
            if !is_frozen_image(name) {
                debug!(image = ?name, "Not a frozen image's name; left alone.");
                continue;
            }
            match self.runtime.remove_tag(name).await {
                Ok(true) => {
                    self.failing.remove(name);
                    info!(image = %name, "Removed frozen image untagged.");
                }
                Ok(false) => {
                    self.failing.remove(name);
                }
                Err(e) => {
                    let error = error_chain(&e);
                    if self.failing.insert(name.clone()) {
                        warn!(image = %name, %error, "Cannot remove a removed frozen image's tag; retrying every sync.");
                    } else {
                        debug!(image = %name, %error, "Removing a frozen image's tag failed again.");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::fake::FakeRuntime;

    #[test]
    fn only_frozen_image_names_are_taken() {
        assert!(is_frozen_image("ongrid/alice-smith/mymodel:v1"));
        for other in [
            "ongrid/dev:latest",
            "ongrid-held/0b6f4a3e-0000-4000-8000-000000000000:latest",
            "python:3.12",
            "ongrid/alice/x",
            "ongrid/Alice/x:v1",
            "ongrid/alice/sub/x:v1",
            "docker.io/ongrid/alice/x:v1",
        ] {
            assert!(!is_frozen_image(other), "{other}");
        }
    }

    #[tokio::test]
    async fn removed_frozen_images_are_untagged_and_nothing_else() {
        let runtime = Arc::new(FakeRuntime::new());
        runtime.add_image("ongrid/alice-smith/old:v1");
        runtime.add_image("ongrid/alice-smith/kept:v1");
        let mut removed = RemovedImages::new(runtime.clone());
        let list = [
            "ongrid/alice-smith/old:v1".to_owned(),
            "ongrid/bob/never-here:v1".to_owned(),
            "ongrid/dev:latest".to_owned(),
        ];
        removed.remove(&list).await;
        let images = runtime.images();
        assert!(!images.contains("ongrid/alice-smith/old:v1"), "{images:?}");
        assert!(images.contains("ongrid/alice-smith/kept:v1"), "{images:?}");
        assert!(
            images.contains("ongrid/dev:latest"),
            "a site image is never removed"
        );

        // A failure is retried on the next pass.
        runtime.add_image("ongrid/alice-smith/old:v1");
        runtime.fail("remove_tag");
        removed.remove(&list).await;
        assert!(runtime.images().contains("ongrid/alice-smith/old:v1"));
        runtime.heal();
        removed.remove(&list).await;
        assert!(!runtime.images().contains("ongrid/alice-smith/old:v1"));
    }
}
