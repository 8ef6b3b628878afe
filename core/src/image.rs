//! Wire types of frozen images: the manager's orders to an agent, the agent's progress
//! reports, and what users see. Image state machine: `BUILDING → READY | FAILED`, then `DELETED`.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::names::{Dn, NodeName, SessionId, SessionName, UserName};

/// squashfs compression of the SIF partition. gzip mounts everywhere; zstd is smaller and faster.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    #[default]
    Gzip,
    Zstd,
}

/// The manager asks the agent running a session to freeze it. Listed in
/// `DesiredState::freezes` until the agent reports it done or failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezeOrder {
    pub image_id: uuid::Uuid,
    pub session_id: SessionId,
    pub session_name: SessionName,
    pub owner: Dn,
    /// `name:version` as the user gave it.
    pub reference: String,
    /// The session's image (the base of the frozen one).
    pub base_image: String,
    pub compression: Compression,
    pub requested_at: DateTime<Utc>,
}

/// Where one freeze stands, as the agent reports it in `NodeReport::freezes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum FreezeProgress {
    Running {
        image_id: uuid::Uuid,
        bytes_done: u64,
        /// Estimated total (the container's filesystem size), 0 when unknown.
        bytes_total: u64,
    },
    Done {
        image_id: uuid::Uuid,
        /// `sha256:<hex>` of the SIF file.
        digest: String,
        size: u64,
        /// The SIF's path in the image store.
        sif_path: String,
        /// The matching Docker image on the node.
        docker_image: String,
    },
    Failed {
        image_id: uuid::Uuid,
        /// One line a user can act on.
        reason: String,
    },
}

impl FreezeProgress {
    pub fn image_id(&self) -> uuid::Uuid {
        match self {
            Self::Running { image_id, .. }
            | Self::Done { image_id, .. }
            | Self::Failed { image_id, .. } => *image_id,
        }
    }
}

/// State of a frozen image: `BUILDING → READY | FAILED`, then `DELETED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ImageState {
    Building,
    Ready,
    Failed,
    Deleted,
}

impl ImageState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Building => "BUILDING",
            Self::Ready => "READY",
            Self::Failed => "FAILED",
            Self::Deleted => "DELETED",
        }
    }

    /// Whether the build has ended, well or not.
    pub fn is_final(self) -> bool {
        !matches!(self, Self::Building)
    }
}

impl fmt::Display for ImageState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ImageState {
    type Err = ImageRefError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "BUILDING" => Ok(Self::Building),
            "READY" => Ok(Self::Ready),
            "FAILED" => Ok(Self::Failed),
            "DELETED" => Ok(Self::Deleted),
            other => Err(ImageRefError(format!("unknown image state {other:?}"))),
        }
    }
}

/// Why an image reference (or digest) was refused; the message says what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ImageRefError(String);

/// The longest image name and version.
pub const MAX_IMAGE_NAME: usize = 128;

/// `name:version`, as users tag frozen images. The name is lower case
/// (`[a-z0-9]` runs joined by single `.`, `_` or `-`, as Docker repository names must be), the
/// version `[A-Za-z0-9._-]+` (a Docker tag), each at most 128 characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageReference {
    name: String,
    version: String,
}

impl ImageReference {
    pub fn parse(text: &str) -> Result<Self, ImageRefError> {
        let bad = |why: &str| {
            ImageRefError(format!(
                "image reference {text:?} {why}: write it as NAME:VERSION, like mymodel:v1 \
                 (name: lower-case letters and digits joined by single . _ or -; version: \
                 letters, digits, . _ -)"
            ))
        };
        let Some((name, version)) = text.split_once(':') else {
            return Err(bad("has no version"));
        };
        if name.is_empty() || name.len() > MAX_IMAGE_NAME {
            return Err(bad("has an empty or too long name"));
        }
        if version.is_empty() || version.len() > MAX_IMAGE_NAME {
            return Err(bad("has an empty or too long version"));
        }
        let separator = |c: char| matches!(c, '.' | '_' | '-');
        let name_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
        if !name.chars().all(|c| name_char(c) || separator(c)) {
            return Err(bad("has a character the name may not hold"));
        }
        let edges_ok = name.starts_with(name_char) && name.ends_with(name_char);
        let doubled = name
            .as_bytes()
            .windows(2)
            .any(|w| separator(w[0] as char) && separator(w[1] as char));
        if !edges_ok || doubled {
            return Err(bad(
                "has a name that does not start and end with a letter or digit, or has two \
                 separators in a row",
            ));
        }
        if !version
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || separator(c))
        {
            return Err(bad("has a character the version may not hold"));
        }
        // Docker tags may not start with `.` or `-`; the matching Docker image carries this tag.
        if version.starts_with(['.', '-']) {
            return Err(bad("has a version that starts with . or -"));
        }
        Ok(Self {
            name: name.to_owned(),
            version: version.to_owned(),
        })
    }

    /// [`Self::parse`] for a new tag (`POST /v1/images`): also refuses tags that look like a
    /// content digest (`sha256:<hex>`, any `shaNNN` name), which `image show`, `image rm` and
    /// `--image` would take for a digest, so the image could never be found by its tag.
    pub fn parse_new(text: &str) -> Result<Self, ImageRefError> {
        let reference = Self::parse(text)?;
        let digest_like_name = reference
            .name
            .strip_prefix("sha")
            .is_some_and(|bits| !bits.is_empty() && bits.chars().all(|c| c.is_ascii_digit()));
        if digest_like_name {
            return Err(ImageRefError(format!(
                "image reference {text:?} looks like a content digest ({}:<hex>), and digests \
                 address images by content, so this tag could never be found: pick another \
                 name, like mymodel:v1",
                reference.name
            )));
        }
        Ok(reference)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    /// The matching Docker image on the node: `ongrid/<login>/<name>:<version>`.
    pub fn docker_image(&self, login: &UserName) -> String {
        format!("ongrid/{login}/{}:{}", self.name, self.version)
    }
}

impl fmt::Display for ImageReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.version)
    }
}

impl FromStr for ImageReference {
    type Err = ImageRefError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl Serialize for ImageReference {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ImageReference {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// Checks a content digest as the image store names files: `sha256:` and 64 lower-case hex
/// digits. Returns the hex part.
pub fn parse_digest(text: &str) -> Result<&str, ImageRefError> {
    let hex = text.strip_prefix("sha256:").unwrap_or("");
    if hex.len() == 64
        && hex
            .chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
    {
        Ok(hex)
    } else {
        Err(ImageRefError(format!(
            "digest {text:?} is not sha256: followed by 64 lower-case hex digits, as \
             `devctl image show` prints it"
        )))
    }
}

/// How a frozen image is addressed in `GET/DELETE /v1/images/{reference}` and by sessions and
/// jobs: by `name:version` (the caller's own current image of that tag), by
/// `login/name:version` (the current image of that tag of the user with that login: one's own,
/// or one its owner shared), or by digest (every image of that content, also one whose tag was
/// moved by `--force`). The three cannot be mistaken for each other: a name never holds `/`, a
/// login never holds `/` or `:`, and tags that look like digests are refused
/// ([`ImageReference::parse_new`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageLookup {
    Reference(ImageReference),
    Owned {
        owner: UserName,
        reference: ImageReference,
    },
    Digest(String),
}

impl ImageLookup {
    pub fn parse(text: &str) -> Result<Self, ImageRefError> {
        if text.starts_with("sha256:") {
            parse_digest(text).map(|_| Self::Digest(text.to_owned()))
        } else if let Some((login, rest)) = text.split_once('/') {
            let owner = UserName::parse(login).map_err(|e| {
                ImageRefError(format!(
                    "image {text:?} names an owner {login:?} that is not a login ({e}): write \
                     LOGIN/NAME:VERSION as `devctl image ls --shared` lists it"
                ))
            })?;
            let reference = ImageReference::parse(rest)?;
            Ok(Self::Owned { owner, reference })
        } else {
            ImageReference::parse(text).map(Self::Reference)
        }
    }
}

impl fmt::Display for ImageLookup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Reference(reference) => reference.fmt(f),
            Self::Owned { owner, reference } => write!(f, "{owner}/{reference}"),
            Self::Digest(digest) => f.write_str(digest),
        }
    }
}

/// `POST /v1/images`: freeze one of the caller's sessions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateImage {
    pub session: SessionName,
    /// `name:version`; never digest-like ([`ImageReference::parse_new`]).
    #[serde(deserialize_with = "new_reference")]
    pub reference: ImageReference,
    /// Move the tag when the caller already has an image of it (the old one stays reachable
    /// by its digest).
    #[serde(default)]
    pub force: bool,
    #[serde(default)]
    pub compression: Compression,
}

fn new_reference<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<ImageReference, D::Error> {
    let text = String::deserialize(deserializer)?;
    ImageReference::parse_new(&text).map_err(serde::de::Error::custom)
}

/// Bytes of the container's filesystem read so far, of the estimated total (0: unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageProgress {
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// A frozen image as users see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageView {
    pub id: uuid::Uuid,
    pub name: String,
    pub version: String,
    /// `name:version`.
    pub reference: String,
    pub owner: Dn,
    pub user_name: UserName,
    pub state: ImageState,
    /// Why it is in its state (the failure's reason, for a FAILED image).
    pub reason: String,
    /// `sha256:<hex>` of the SIF file, once READY.
    pub digest: Option<String>,
    /// Size of the SIF file in bytes, once READY.
    pub size: Option<u64>,
    /// The SIF file in the image store, once READY.
    pub sif_path: Option<String>,
    /// The matching Docker image on `node`: `ongrid/<login>/<name>:<version>`.
    pub docker_image: Option<String>,
    pub node: NodeName,
    pub session: SessionName,
    pub session_id: SessionId,
    /// The session's image, the base of this one.
    pub base_image: String,
    pub compression: Compression,
    pub created_at: DateTime<Utc>,
    /// When it became READY, FAILED or DELETED.
    pub finished_at: Option<DateTime<Utc>>,
    /// Set when `freeze --force` moved the tag to a newer image: this one is reachable by its
    /// digest only.
    pub superseded_at: Option<DateTime<Utc>>,
    /// While BUILDING.
    pub progress: Option<ImageProgress>,
    /// Shared by its owner (`devctl image share`): any user may run it, as
    /// `<user_name>/<reference>` or by digest.
    #[serde(default)]
    pub shared: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_like_docker_names() {
        let r = ImageReference::parse("mymodel:v1").unwrap();
        assert_eq!((r.name(), r.version()), ("mymodel", "v1"));
        assert_eq!(r.to_string(), "mymodel:v1");
        assert_eq!(
            r.docker_image(&UserName::parse("alice-smith").unwrap()),
            "ongrid/alice-smith/mymodel:v1"
        );
        for good in ["a:1", "my.model_x-2:V1.0-rc_1", "0:0"] {
            ImageReference::parse(good).unwrap();
        }
        for bad in [
            "mymodel",
            "MyModel:v1",
            ":v1",
            "m:",
            "-m:v1",
            "m-:v1",
            "a..b:v1",
            "m:v 1",
            "m:v/1",
            "m:v:1",
            "m:.v1",
            "m:-v1",
            "ü:v1",
        ] {
            let err = ImageReference::parse(bad).unwrap_err().to_string();
            assert!(err.contains("NAME:VERSION"), "{bad}: {err}");
        }
        let long = format!("{}:v1", "a".repeat(129));
        assert!(ImageReference::parse(&long).is_err());
    }

    #[test]
    fn references_round_trip_as_json_strings() {
        let body = CreateImage {
            session: SessionName::parse("train1").unwrap(),
            reference: ImageReference::parse("mymodel:v1").unwrap(),
            force: false,
            compression: Compression::Zstd,
        };
        let json = serde_json::to_string(&body).unwrap();
        assert_eq!(
            json,
            r#"{"session":"train1","reference":"mymodel:v1","force":false,"compression":"zstd"}"#
        );
        assert_eq!(serde_json::from_str::<CreateImage>(&json).unwrap(), body);
        let minimal: CreateImage =
            serde_json::from_str(r#"{"session":"train1","reference":"m:1"}"#).unwrap();
        assert_eq!(minimal.compression, Compression::Gzip);
        assert!(!minimal.force);
        assert!(
            serde_json::from_str::<CreateImage>(r#"{"session":"t","reference":"M:1"}"#).is_err()
        );
    }

    #[test]
    fn new_tags_that_look_like_digests_are_refused() {
        let digest_tag = format!("sha256:{}", "ab".repeat(32));
        // Stored ones still read back (a tag made before the rule must stay listable).
        ImageReference::parse(&digest_tag).unwrap();
        for bad in [digest_tag.as_str(), "sha256:v1", "sha512:1", "sha1:x"] {
            let err = ImageReference::parse_new(bad).unwrap_err().to_string();
            assert!(err.contains("looks like a content digest"), "{bad}: {err}");
            let body = format!(r#"{{"session":"t","reference":"{bad}"}}"#);
            let err = serde_json::from_str::<CreateImage>(&body)
                .unwrap_err()
                .to_string();
            assert!(err.contains("looks like a content digest"), "{bad}: {err}");
        }
        for good in ["sha:1", "shab:1", "mysha256:v1", "m:sha256"] {
            ImageReference::parse_new(good).unwrap();
        }
        let unknown = r#"{"session":"t","reference":"m:1","evil":true}"#;
        let err = serde_json::from_str::<CreateImage>(unknown)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `evil`"), "{err}");
    }

    #[test]
    fn lookups_tell_digests_from_references() {
        let digest = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(
            ImageLookup::parse(&digest).unwrap(),
            ImageLookup::Digest(digest.clone())
        );
        assert!(ImageLookup::parse("sha256:abc").is_err());
        assert!(ImageLookup::parse(&digest.to_uppercase().replace("SHA256", "sha256")).is_err());
        assert!(matches!(
            ImageLookup::parse("m:v1").unwrap(),
            ImageLookup::Reference(_)
        ));
        let owned = ImageLookup::parse("alice-smith/m:v1").unwrap();
        assert_eq!(
            owned,
            ImageLookup::Owned {
                owner: UserName::parse("alice-smith").unwrap(),
                reference: ImageReference::parse("m:v1").unwrap(),
            }
        );
        assert_eq!(owned.to_string(), "alice-smith/m:v1");
        for bad in ["/m:v1", "Alice/m:v1", "alice/m", "alice/b/m:v1", "a:b/m:v1"] {
            assert!(ImageLookup::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn states_round_trip() {
        for state in [
            ImageState::Building,
            ImageState::Ready,
            ImageState::Failed,
            ImageState::Deleted,
        ] {
            assert_eq!(state.as_str().parse::<ImageState>().unwrap(), state);
            assert_eq!(
                serde_json::to_string(&state).unwrap(),
                format!("\"{}\"", state.as_str())
            );
        }
    }
}
