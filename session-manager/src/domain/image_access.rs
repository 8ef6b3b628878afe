//! Which Docker image a session may run, and which Docker images must leave the nodes.
//!
//! A session runs one of the site's images (the manager's `default_image` and
//! `allowed_images`, named as Docker names them) or one of its owner's own READY frozen images,
//! named as `devctl image` names them: `name:version` or `sha256:<hex>`. A raw Docker name is
//! never taken for a frozen image: `ongrid/<someone>/<name>:<version>` is refused like any name
//! outside the site's list, so nobody starts a session from someone else's frozen image.
//!
//! An owner may share a READY image ([`share`]): then any user may run it ([`may_run`]), named
//! `login/name:version` (the owner's login, as `devctl image ls --shared` lists it) or by its
//! digest. `name:version` alone always means the caller's own image, so another user's sharing
//! never changes what a caller's own tag runs. Sessions ([`resolve_frozen`]) and jobs
//! ([`super::jobs::resolve_image`]) apply the same rule.
//!
//! When a frozen image is removed, its Docker image must go from the nodes too:
//! [`removed_docker_images`] lists those removed within [`REMOVED_IMAGE_RETENTION`] that no
//! current image has taken over, for every node's desired state.

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ongrid_core::image::{ImageLookup, ImageState};
use ongrid_core::Dn;

use super::images::ImageRecord;
use super::Refusal;

/// How long a removed frozen image's Docker name stays in the nodes' desired state: an agent
/// that syncs within this time untags it.
pub const REMOVED_IMAGE_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The Docker images of the site any session may run: the default first, then the admin's list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiteImages<'a> {
    pub default: &'a str,
    pub allowed: &'a [String],
}

impl SiteImages<'_> {
    fn contains(&self, image: &str) -> bool {
        image == self.default || self.allowed.iter().any(|a| a == image)
    }

    fn listed(&self) -> String {
        std::iter::once(self.default)
            .chain(
                self.allowed
                    .iter()
                    .map(String::as_str)
                    .filter(|a| *a != self.default),
            )
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The end of every refusal: what may be used instead.
    fn what_may_be_used(&self) -> String {
        format!(
            "a session may use the site's images ({}), one of your READY frozen images by \
             NAME:VERSION or sha256 digest, as `devctl image ls` lists them, or an image shared \
             by its owner, as LOGIN/NAME:VERSION from `devctl image ls --shared`",
            self.listed()
        )
    }
}

/// What a `CreateSession.image` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageChoice {
    /// One of the site's Docker images.
    Site(String),
    /// One of the caller's frozen images, still to be looked up.
    Frozen(ImageLookup),
}

/// Reads the requested image: absent → the site's default; a site image (exactly as the site
/// lists it) → itself; else a frozen image's tag or digest; anything else is refused.
pub fn choose_image(
    requested: Option<&str>,
    site: &SiteImages<'_>,
) -> Result<ImageChoice, Refusal> {
    let Some(requested) = requested.map(str::trim) else {
        return Ok(ImageChoice::Site(site.default.to_owned()));
    };
    if site.contains(requested) {
        return Ok(ImageChoice::Site(requested.to_owned()));
    }
    ImageLookup::parse(requested)
        .map(ImageChoice::Frozen)
        .map_err(|_| {
            Refusal::Forbidden(format!(
                "image {requested:?} is not allowed: {}",
                site.what_may_be_used()
            ))
        })
}

/// Whether `caller` may run `image`: it is theirs, or its owner shares it.
pub fn may_run(image: &ImageRecord, caller: &Dn) -> bool {
    &image.owner == caller || image.shared_at.is_some()
}

/// Why the images a lookup found cannot be run by the caller: the start of a refusal, or
/// `None` when the caller may run none of them. Then the refusal is [`no_image_you_may_run`],
/// the same whether another user's private image exists under that name or nothing does, so a
/// refusal never tells that someone else's private image exists.
pub fn not_runnable(
    lookup: &ImageLookup,
    candidates: &[ImageRecord],
    caller: &Dn,
) -> Option<String> {
    let runnable: Vec<&ImageRecord> = candidates.iter().filter(|i| may_run(i, caller)).collect();
    let image = runnable.last()?;
    let whose = if &image.owner == caller {
        "your image"
    } else {
        "image"
    };
    Some(if image.state != ImageState::Ready {
        format!(
            "{whose} {lookup} is {}, not READY (see `devctl image show {lookup}`)",
            image.state
        )
    } else if image.superseded_at.is_some() {
        format!(
            "{whose} {lookup} was superseded by a newer freeze of {} and its Docker image now \
             holds the newer one",
            image.reference
        )
    } else {
        format!("{whose} {lookup} has no Docker image")
    })
}

/// The refusal for a lookup that finds no image the caller may run: none exists, or only
/// another user's private one (which it must not tell apart).
pub fn no_image_you_may_run(lookup: &ImageLookup) -> String {
    format!(
        "there is no frozen image {lookup} that you may run (yours are listed by `devctl image \
         ls`, shared ones by `devctl image ls --shared`; another user's image runs only once \
         they share it)"
    )
}

/// The Docker image of the frozen image `lookup` for a session of `caller`, from `candidates`
/// (the store's answer for the lookup: the caller's own tag, a login's tag, or anyone's images
/// of a digest). Only an image the caller may run ([`may_run`]) that is READY and whose tag is
/// still its own (not superseded by `freeze --force`, which moved the Docker tag to the newer
/// image) can start a session.
pub fn resolve_frozen(
    lookup: &ImageLookup,
    candidates: &[ImageRecord],
    caller: &Dn,
    site: &SiteImages<'_>,
) -> Result<String, Refusal> {
    let usable = candidates.iter().find(|i| {
        may_run(i, caller)
            && i.state == ImageState::Ready
            && i.superseded_at.is_none()
            && i.docker_image.is_some()
    });
    if let Some(docker_image) = usable.and_then(|i| i.docker_image.clone()) {
        return Ok(docker_image);
    }
    let why =
        not_runnable(lookup, candidates, caller).unwrap_or_else(|| no_image_you_may_run(lookup));
    Err(Refusal::Forbidden(format!(
        "{why}: {}",
        site.what_may_be_used()
    )))
}

/// The new `shared_at` of `image` when `caller` asks to share it (`share`) or to make it
/// private again. Only the owner decides, an admin included; only a READY image whose tag is
/// still its own can be shared. Sharing again keeps the first time.
pub fn share(
    image: &ImageRecord,
    caller: &Dn,
    share: bool,
    now: DateTime<Utc>,
) -> Result<Option<DateTime<Utc>>, Refusal> {
    let reference = &image.reference;
    if &image.owner != caller {
        return Err(Refusal::Forbidden(format!(
            "only {} (its owner) can share or unshare image {reference}",
            image.user_name
        )));
    }
    if !share {
        return Ok(None);
    }
    if image.state != ImageState::Ready {
        return Err(Refusal::Conflict(format!(
            "image {reference} is {}: only a READY image can be shared (see `devctl image show \
             {reference}`)",
            image.state
        )));
    }
    if image.superseded_at.is_some() {
        return Err(Refusal::Conflict(format!(
            "this image was superseded by a newer freeze of {reference}: share the current one \
             (`devctl image share {reference}`)"
        )));
    }
    Ok(Some(image.shared_at.unwrap_or(now)))
}

/// The Docker names of the frozen images `removed` (DELETED within the retention window) that
/// no image of `current` (every image not DELETED, superseded ones included) has taken over: a
/// tag removed and then frozen again must stay.
pub fn removed_docker_images(removed: &[ImageRecord], current: &[ImageRecord]) -> Vec<String> {
    let taken: BTreeSet<String> = current
        .iter()
        .filter(|i| i.state != ImageState::Deleted)
        .map(|i| i.reference.docker_image(&i.user_name))
        .collect();
    let gone: BTreeSet<String> = removed
        .iter()
        .filter(|i| i.state == ImageState::Deleted)
        .map(|i| i.reference.docker_image(&i.user_name))
        .filter(|name| !taken.contains(name))
        .collect();
    gone.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use ongrid_core::image::ImageReference;
    use ongrid_core::{Dn, UserName};

    use super::*;
    use crate::domain::fixtures::{alice, t};

    fn image(owner: &str, login: &str, reference: &str, state: ImageState) -> ImageRecord {
        let reference = ImageReference::parse(reference).unwrap();
        let user_name = UserName::parse(login).unwrap();
        ImageRecord {
            owner: Dn::parse(owner).unwrap(),
            docker_image: (state == ImageState::Ready).then(|| reference.docker_image(&user_name)),
            user_name,
            reference,
            state,
            digest: Some(format!("sha256:{}", "ab".repeat(32))),
            size: Some(1),
            ..crate::domain::images::fixtures::image()
        }
    }

    const ALLOWED: [String; 0] = [];

    fn site(allowed: &[String]) -> SiteImages<'_> {
        SiteImages {
            default: "ongrid/dev:latest",
            allowed,
        }
    }

    #[test]
    fn site_images_are_taken_as_docker_names_and_the_rest_as_frozen_images() {
        let allowed = ["python:3.12".to_owned()];
        let site = site(&allowed);
        assert_eq!(
            choose_image(None, &site).unwrap(),
            ImageChoice::Site("ongrid/dev:latest".to_owned())
        );
        assert_eq!(
            choose_image(Some(" python:3.12 "), &site).unwrap(),
            ImageChoice::Site("python:3.12".to_owned())
        );
        assert!(matches!(
            choose_image(Some("mymodel:v1"), &site).unwrap(),
            ImageChoice::Frozen(ImageLookup::Reference(_))
        ));
        let digest = format!("sha256:{}", "cd".repeat(32));
        assert!(matches!(
            choose_image(Some(&digest), &site).unwrap(),
            ImageChoice::Frozen(ImageLookup::Digest(_))
        ));
        for raw in [
            "ongrid/bob/secret:v1",
            "ubuntu",
            "docker.io/library/python:3.12",
            "sha256:abc",
        ] {
            let Err(Refusal::Forbidden(message)) = choose_image(Some(raw), &site) else {
                panic!("{raw} was not refused");
            };
            assert!(
                message.contains("ongrid/dev:latest, python:3.12")
                    && message.contains("devctl image ls"),
                "{message}"
            );
        }
    }

    #[test]
    fn only_the_callers_own_current_ready_images_resolve() {
        let lookup = ImageLookup::parse("mymodel:v1").unwrap();
        let site = site(&ALLOWED);
        let own = image("/CN=Alice", "alice", "mymodel:v1", ImageState::Ready);
        assert_eq!(
            resolve_frozen(&lookup, std::slice::from_ref(&own), &alice(), &site).unwrap(),
            "ongrid/alice/mymodel:v1"
        );
        let refused =
            |candidates: &[ImageRecord]| match resolve_frozen(&lookup, candidates, &alice(), &site)
            {
                Err(Refusal::Forbidden(message)) => message,
                other => panic!("{other:?}"),
            };
        let bobs = image("/CN=Bob", "bob", "mymodel:v1", ImageState::Ready);
        // Bob's private image and no image at all are refused alike: nothing tells Alice that
        // Bob has one.
        assert_eq!(refused(&[bobs]), refused(&[]));
        assert!(refused(&[]).contains("there is no frozen image mymodel:v1 that you may run"));
        assert!(refused(&[]).contains("ongrid/dev:latest"));
        let building = image("/CN=Alice", "alice", "mymodel:v1", ImageState::Building);
        assert!(refused(&[building]).contains("BUILDING, not READY"));
        let mut superseded = own.clone();
        superseded.superseded_at = Some(t(5));
        assert!(refused(&[superseded.clone()]).contains("superseded"));
        // By digest, the current one of several wins.
        assert_eq!(
            resolve_frozen(&lookup, &[superseded, own], &alice(), &site).unwrap(),
            "ongrid/alice/mymodel:v1"
        );
    }

    #[test]
    fn another_users_image_runs_only_while_its_owner_shares_it() {
        let site = site(&ALLOWED);
        let bob = Dn::parse("/CN=Bob").unwrap();
        let lookup = ImageLookup::parse("alice/mymodel:v1").unwrap();
        let mut alices = image("/CN=Alice", "alice", "mymodel:v1", ImageState::Ready);
        let refused =
            |candidates: &[ImageRecord]| match resolve_frozen(&lookup, candidates, &bob, &site) {
                Err(Refusal::Forbidden(message)) => message,
                other => panic!("{other:?}"),
            };
        assert!(!may_run(&alices, &bob));
        assert!(may_run(&alices, &alice()));
        assert_eq!(refused(std::slice::from_ref(&alices)), refused(&[]));
        assert!(refused(&[]).contains("there is no frozen image alice/mymodel:v1 that you may run"));

        alices.shared_at = Some(share(&alices, &alice(), true, t(10)).unwrap().unwrap());
        assert!(may_run(&alices, &bob));
        assert_eq!(
            resolve_frozen(&lookup, std::slice::from_ref(&alices), &bob, &site).unwrap(),
            "ongrid/alice/mymodel:v1"
        );
        // By digest too, and a shared image that is not READY says so.
        let digest = ImageLookup::parse(&format!("sha256:{}", "ab".repeat(32))).unwrap();
        resolve_frozen(&digest, std::slice::from_ref(&alices), &bob, &site).unwrap();
        let mut failed = alices.clone();
        failed.state = ImageState::Failed;
        assert!(refused(&[failed]).contains("image alice/mymodel:v1 is FAILED, not READY"));

        alices.shared_at = share(&alices, &alice(), false, t(20)).unwrap();
        assert!(!may_run(&alices, &bob));
        assert_eq!(refused(&[alices]), refused(&[]));
    }

    #[test]
    fn only_the_owner_shares_and_only_a_current_ready_image() {
        let bob = Dn::parse("/CN=Bob").unwrap();
        let mut ready = image("/CN=Alice", "alice", "mymodel:v1", ImageState::Ready);
        assert_eq!(share(&ready, &alice(), true, t(10)), Ok(Some(t(10))));
        ready.shared_at = Some(t(10));
        // Sharing again keeps the first time; unsharing clears it.
        assert_eq!(share(&ready, &alice(), true, t(20)), Ok(Some(t(10))));
        assert_eq!(share(&ready, &alice(), false, t(20)), Ok(None));
        for wish in [true, false] {
            assert!(matches!(
                share(&ready, &bob, wish, t(20)),
                Err(Refusal::Forbidden(m)) if m.contains("only alice (its owner)")
            ));
        }
        for state in [ImageState::Building, ImageState::Failed] {
            let not_ready = image("/CN=Alice", "alice", "mymodel:v1", state);
            assert!(matches!(
                share(&not_ready, &alice(), true, t(20)),
                Err(Refusal::Conflict(m)) if m.contains("only a READY image can be shared")
            ));
            assert_eq!(share(&not_ready, &alice(), false, t(20)), Ok(None));
        }
        let mut superseded = ready.clone();
        superseded.superseded_at = Some(t(15));
        assert!(matches!(
            share(&superseded, &alice(), true, t(20)),
            Err(Refusal::Conflict(m)) if m.contains("share the current one")
        ));
    }

    #[test]
    fn removed_images_leave_the_nodes_unless_their_tag_was_frozen_again() {
        let removed = [
            image("/CN=Alice", "alice", "old:v1", ImageState::Deleted),
            image("/CN=Alice", "alice", "again:v1", ImageState::Deleted),
            image("/CN=Bob", "bob", "old:v1", ImageState::Deleted),
        ];
        let current = [image(
            "/CN=Alice",
            "alice",
            "again:v1",
            ImageState::Building,
        )];
        assert_eq!(
            removed_docker_images(&removed, &current),
            ["ongrid/alice/old:v1", "ongrid/bob/old:v1"]
        );
        assert!(removed_docker_images(&[], &current).is_empty());
    }
}
