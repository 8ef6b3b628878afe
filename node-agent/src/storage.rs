//! Site storage in containers: the agent's `[storage]` table, validated into [`SiteStorage`].
//!
//! A site mounts the same storage on every GPU node (CVMFS, software areas, shared scratch,
//! home directories on NFS or a parallel file system). `[storage]` bind-mounts it into every
//! container the agent makes, dev containers and batch job containers alike:
//!
//! ```toml
//! [storage]
//! home = "/site/home/{login}"        # the user's home on site storage; default: a Docker volume
//! home_mode = "0700"                 # a new home's mode (owner: the user's uid and gid)
//! [[storage.read_only]]
//! source = "/cvmfs"                  # must exist on the node when the agent starts
//! propagation = "rslave"             # optional: autofs mounts made later show up inside
//! [[storage.read_only]]
//! source = "/opt/site-software"
//! target = "/software"               # default: the same path as source
//! [[storage.read_write]]
//! source = "/site/scratch/{login}"   # must exist when a container of the user is made
//! target = "/scratch"
//! ```
//!
//! Without `home`, each user's home is the node-local Docker volume `ongrid-home-<login>` (the
//! quickstart's case); with it, the home is the directory `home` names, which follows the user
//! to any node. Paths are absolute, without `.` or `..`; `{login}` and `{uid}` are the only
//! placeholders, allowed in `home` and in `read_write` entries. A home that does not exist is
//! made by the agent ([`crate::runtime::site_dirs::ensure_home_directory`]) below the part of
//! `home` before its first placeholder, which must exist on the node (the site storage is
//! mounted): an unmounted file system never silently becomes a node-local home.
//!
//! What is mounted is never part of a frozen image: `docker commit` leaves bind mounts and
//! volumes out, and the freeze exports a new container of the commit that has no mounts at all.

use std::path::{Component, Path, PathBuf};

use ongrid_core::api::ContainerUser;
use serde::Deserialize;

use crate::runtime::{home_volume_name, BindMount, ContainerSpec, Home, Propagation};

/// Why `[storage]` was refused. Each message names the key and what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StorageError {
    #[error("{key} {path:?} must be an absolute path, like /cvmfs")]
    NotAbsolute { key: &'static str, path: String },
    #[error("{key} {path:?} must not contain `.` or `..` components: write the path it means")]
    DotComponent { key: &'static str, path: String },
    #[error("{key} {path:?} uses {found:?}: the only placeholders are {{login}} and {{uid}}")]
    Placeholder {
        key: &'static str,
        path: String,
        found: String,
    },
    #[error("{key} {path:?} must be one directory for everybody: {{login}} and {{uid}} are only for [storage] home and [[storage.read_write]]")]
    SharedSourceTemplate { key: &'static str, path: String },
    #[error("{key} {path:?} does not exist on this node: mount it (CVMFS under /cvmfs, the software area, ...) or remove the entry")]
    SourceMissing { key: &'static str, path: String },
    #[error("[storage] home {0:?} must contain {{login}} or {{uid}}, so that each user gets their own home")]
    SharedHome(String),
    #[error("[storage] home: {root} does not exist on this node: mount the site's home storage there, or fix [storage] home")]
    HomeRootMissing { root: PathBuf },
    #[error("[storage] home_mode {0:?} is not an octal mode like \"0700\" or \"0750\"")]
    HomeMode(String),
    #[error("[storage] home_mode is set but home is not: set home = \"/site/home/{{login}}\" or remove home_mode")]
    ModeWithoutHome,
    #[error("{key} target {target:?} is a path ongrid or the system needs in the container ({why}): choose another target")]
    ReservedTarget {
        key: &'static str,
        target: String,
        why: &'static str,
    },
    #[error("{key} target {target:?} is mounted twice: give each entry its own target")]
    DuplicateTarget { key: &'static str, target: String },
    #[error("{key} propagation {value:?} is not one of \"rprivate\", \"rslave\", \"rshared\"")]
    Propagation { key: &'static str, value: String },
}

const HOME: &str = "[storage] home";
const RO_SOURCE: &str = "[[storage.read_only]] source";
const RO_TARGET: &str = "[[storage.read_only]] target";
const RO: &str = "[[storage.read_only]]";
const RW_SOURCE: &str = "[[storage.read_write]] source";
const RW_TARGET: &str = "[[storage.read_write]] target";
const RW: &str = "[[storage.read_write]]";

/// The `[storage]` table as written; [`StorageFile::validate`] checks it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageFile {
    /// The user's home on site storage, like `/site/home/{login}`; absent: a Docker volume.
    home: Option<String>,
    /// The mode of a home the agent makes, octal; default `0700`.
    home_mode: Option<String>,
    /// Mounted read-only into every container (CVMFS, software areas).
    #[serde(default)]
    read_only: Vec<MountFile>,
    /// Mounted read-write into every container (scratch, project areas).
    #[serde(default)]
    read_write: Vec<MountFile>,
}

/// One `[[storage.read_only]]` or `[[storage.read_write]]` entry as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MountFile {
    source: String,
    /// Where it appears in the container; default: `source`.
    target: Option<String>,
    /// `rprivate` (Docker's default), `rslave` or `rshared`.
    propagation: Option<String>,
}

/// A path that may name the user: absolute, no `.` or `..`, `{login}` and `{uid}` only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTemplate(String);

impl PathTemplate {
    /// Checks `text` as the value of `key`.
    pub fn parse(key: &'static str, text: &str) -> Result<Self, StorageError> {
        if !text.starts_with('/') {
            return Err(StorageError::NotAbsolute {
                key,
                path: text.to_owned(),
            });
        }
        if text.split('/').any(|part| part == ".." || part == ".") {
            return Err(StorageError::DotComponent {
                key,
                path: text.to_owned(),
            });
        }
        let mut rest = text;
        while let Some(at) = rest.find(['{', '}']) {
            let after = &rest[at..];
            let placeholder = after
                .strip_prefix('{')
                .and_then(|inner| inner.find('}').map(|end| &after[..end + 2]));
            match placeholder {
                Some(found @ ("{login}" | "{uid}")) => rest = &after[found.len()..],
                other => {
                    return Err(StorageError::Placeholder {
                        key,
                        path: text.to_owned(),
                        found: other.unwrap_or(&after[..1]).to_owned(),
                    })
                }
            }
        }
        Ok(Self(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn has_placeholders(&self) -> bool {
        self.0.contains('{')
    }

    /// The path for `user`.
    pub fn expand(&self, user: &ContainerUser) -> PathBuf {
        PathBuf::from(
            self.0
                .replace("{login}", user.name.as_str())
                .replace("{uid}", &user.uid.to_string()),
        )
    }

    /// The directories before the first component with a placeholder (the whole path when it
    /// has none): what must exist on the node before anything below it is made.
    pub fn fixed_root(&self) -> PathBuf {
        Path::new(&self.0)
            .components()
            .take_while(|c| !c.as_os_str().to_string_lossy().contains('{'))
            .collect()
    }
}

/// One site mount of the validated config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiteMount {
    pub source: PathTemplate,
    pub target: PathTemplate,
    pub read_only: bool,
    pub propagation: Propagation,
}

/// Where users' homes live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HomeStorage {
    /// The node-local Docker volume `ongrid-home-<login>`.
    Volume,
    /// A directory on site storage; the agent makes a missing one with `mode`, owned by the user.
    Directory { path: PathTemplate, mode: u32 },
}

/// The validated `[storage]` table: homes and the mounts of every container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiteStorage {
    pub home: HomeStorage,
    pub mounts: Vec<SiteMount>,
}

impl Default for SiteStorage {
    /// Homes on node-local volumes, nothing else mounted (no `[storage]` table).
    fn default() -> Self {
        Self {
            home: HomeStorage::Volume,
            mounts: Vec::new(),
        }
    }
}

/// The home mode when `home_mode` is absent: only the user.
pub const DEFAULT_HOME_MODE: u32 = 0o700;

/// Targets a site mount may not take: what the container needs from its image or from ongrid.
const RESERVED_TARGETS: [(&str, &str); 7] = [
    ("/proc", "the kernel's"),
    ("/sys", "the kernel's"),
    ("/dev", "the container's devices"),
    ("/etc", "the user's account is written there"),
    ("/run/ongrid", "ongrid's injected tools"),
    (
        ongrid_core::job::WORK_DIR_IN_CONTAINER,
        "a batch job's working directory",
    ),
    ("/home", "the users' homes"),
];

impl StorageFile {
    /// Checks every path, and that what must exist now does.
    pub fn validate(self) -> Result<SiteStorage, StorageError> {
        let home = match (self.home, self.home_mode) {
            (None, None) => HomeStorage::Volume,
            (None, Some(_)) => return Err(StorageError::ModeWithoutHome),
            (Some(text), mode) => {
                let path = PathTemplate::parse(HOME, &text)?;
                if !path.has_placeholders() {
                    return Err(StorageError::SharedHome(text));
                }
                let root = path.fixed_root();
                if !root.is_dir() {
                    return Err(StorageError::HomeRootMissing { root });
                }
                let mode = match mode {
                    None => DEFAULT_HOME_MODE,
                    Some(mode) => u32::from_str_radix(mode.trim(), 8)
                        .ok()
                        .filter(|m| *m <= 0o777)
                        .ok_or(StorageError::HomeMode(mode))?,
                };
                HomeStorage::Directory { path, mode }
            }
        };
        let mut mounts = Vec::new();
        for entry in self.read_only {
            let source = PathTemplate::parse(RO_SOURCE, &entry.source)?;
            if source.has_placeholders() {
                return Err(StorageError::SharedSourceTemplate {
                    key: RO_SOURCE,
                    path: entry.source,
                });
            }
            if !Path::new(source.as_str()).exists() {
                return Err(StorageError::SourceMissing {
                    key: RO_SOURCE,
                    path: entry.source,
                });
            }
            mounts.push(entry.validate_rest(source, RO, RO_TARGET, true)?);
        }
        for entry in self.read_write {
            let source = PathTemplate::parse(RW_SOURCE, &entry.source)?;
            if !source.has_placeholders() && !Path::new(source.as_str()).exists() {
                return Err(StorageError::SourceMissing {
                    key: RW_SOURCE,
                    path: entry.source,
                });
            }
            mounts.push(entry.validate_rest(source, RW, RW_TARGET, false)?);
        }
        for (i, mount) in mounts.iter().enumerate() {
            if mounts[..i].iter().any(|m| m.target == mount.target) {
                return Err(StorageError::DuplicateTarget {
                    key: if mount.read_only {
                        RO_TARGET
                    } else {
                        RW_TARGET
                    },
                    target: mount.target.as_str().to_owned(),
                });
            }
        }
        Ok(SiteStorage { home, mounts })
    }
}

impl MountFile {
    fn validate_rest(
        self,
        source: PathTemplate,
        table: &'static str,
        target_key: &'static str,
        read_only: bool,
    ) -> Result<SiteMount, StorageError> {
        let target = match self.target {
            None => source.clone(),
            Some(text) => PathTemplate::parse(target_key, &text)?,
        };
        let normal = Path::new(target.as_str())
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .count();
        if normal == 0 {
            return Err(StorageError::ReservedTarget {
                key: target_key,
                target: target.as_str().to_owned(),
                why: "the container's root",
            });
        }
        let target_path = Path::new(target.as_str());
        for (reserved, why) in RESERVED_TARGETS {
            // `/home` itself and what is under `/proc` etc.; a directory inside a home is fine.
            let taken = if reserved == "/home" {
                target_path == Path::new(reserved)
                    || target_path.parent() == Some(Path::new(reserved))
            } else {
                target_path.starts_with(reserved)
            };
            if taken {
                return Err(StorageError::ReservedTarget {
                    key: target_key,
                    target: target.as_str().to_owned(),
                    why,
                });
            }
        }
        let propagation = match self.propagation.as_deref() {
            None | Some("rprivate") => Propagation::Private,
            Some("rslave") => Propagation::Slave,
            Some("rshared") => Propagation::Shared,
            Some(other) => {
                return Err(StorageError::Propagation {
                    key: table,
                    value: other.to_owned(),
                })
            }
        };
        Ok(SiteMount {
            source,
            target,
            read_only,
            propagation,
        })
    }
}

impl SiteStorage {
    /// The home and the site mounts of `user`'s containers.
    pub fn for_user(&self, user: &ContainerUser) -> (Home, Vec<BindMount>) {
        let home = match &self.home {
            HomeStorage::Volume => Home::Volume(home_volume_name(user)),
            HomeStorage::Directory { path, mode } => Home::Directory {
                path: path.expand(user),
                root: path.fixed_root(),
                mode: *mode,
            },
        };
        let binds = self
            .mounts
            .iter()
            .map(|mount| BindMount {
                source: mount.source.expand(user),
                target: mount.target.expand(user).display().to_string(),
                read_only: mount.read_only,
                propagation: mount.propagation,
            })
            .collect();
        (home, binds)
    }

    /// Gives `spec` the user's home and the site mounts.
    pub fn apply(&self, spec: &mut ContainerSpec) {
        let (home, binds) = self.for_user(&spec.user);
        spec.home = home;
        spec.binds = binds;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::site_dirs::missing_source;
    use ongrid_core::UserName;

    fn user() -> ContainerUser {
        ContainerUser {
            name: UserName::parse("alice-smith").unwrap(),
            uid: 20001,
        }
    }

    fn parse(text: &str) -> Result<SiteStorage, StorageError> {
        let file: StorageFile = toml::from_str(text).unwrap();
        file.validate()
    }

    #[test]
    fn without_the_table_homes_are_volumes_and_nothing_is_mounted() {
        let storage = parse("").unwrap();
        assert_eq!(storage, SiteStorage::default());
        let (home, binds) = storage.for_user(&user());
        assert_eq!(home, Home::Volume("ongrid-home-alice-smith".into()));
        assert!(binds.is_empty());
    }

    #[test]
    fn a_full_table_expands_per_user() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().display();
        std::fs::create_dir_all(dir.path().join("home")).unwrap();
        std::fs::create_dir_all(dir.path().join("cvmfs")).unwrap();
        std::fs::create_dir_all(dir.path().join("sw")).unwrap();
        let storage = parse(&format!(
            "home = \"{root}/home/{{login}}\"\nhome_mode = \"0750\"\n\
             [[read_only]]\nsource = \"{root}/cvmfs\"\ntarget = \"/cvmfs\"\npropagation = \"rslave\"\n\
             [[read_only]]\nsource = \"{root}/sw\"\ntarget = \"/software\"\n\
             [[read_write]]\nsource = \"{root}/scratch/{{uid}}\"\ntarget = \"/scratch/{{login}}\"\n"
        ))
        .unwrap();
        let (home, binds) = storage.for_user(&user());
        assert_eq!(
            home,
            Home::Directory {
                path: dir.path().join("home/alice-smith"),
                root: dir.path().join("home"),
                mode: 0o750,
            }
        );
        assert_eq!(
            binds,
            [
                BindMount {
                    source: dir.path().join("cvmfs"),
                    target: "/cvmfs".into(),
                    read_only: true,
                    propagation: Propagation::Slave,
                },
                BindMount {
                    source: dir.path().join("sw"),
                    target: "/software".into(),
                    read_only: true,
                    propagation: Propagation::Private,
                },
                BindMount {
                    source: dir.path().join("scratch/20001"),
                    target: "/scratch/alice-smith".into(),
                    read_only: false,
                    propagation: Propagation::Private,
                },
            ]
        );
        assert_eq!(
            missing_source(&binds, &user()).unwrap(),
            format!(
                "site storage {root}/scratch/20001 does not exist on this node: make it for \
                 user alice-smith (uid 20001), or fix [storage] in the agent's config"
            )
        );
        std::fs::create_dir_all(dir.path().join("scratch/20001")).unwrap();
        assert_eq!(missing_source(&binds, &user()), None);
    }

    #[test]
    fn a_target_defaults_to_the_source_and_the_mode_to_0700() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().display();
        let storage = parse(&format!(
            "home = \"{root}/{{uid}}/home\"\n[[read_only]]\nsource = \"{root}\"\n"
        ))
        .unwrap();
        let HomeStorage::Directory { path, mode } = &storage.home else {
            panic!("a directory home");
        };
        assert_eq!(*mode, DEFAULT_HOME_MODE);
        assert_eq!(path.fixed_root(), dir.path());
        assert_eq!(storage.mounts[0].target.as_str(), root.to_string());
    }

    #[test]
    fn bad_paths_name_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().display().to_string();
        let cases = [
            ("home = \"site/{login}\"", "[storage] home \"site/{login}\" must be an absolute path"),
            ("home = \"/site/../{login}\"", "must not contain `.` or `..`"),
            ("home = \"/site/{user}\"", "uses \"{user}\": the only placeholders are {login} and {uid}"),
            ("home = \"/site/{login\"", "uses \"{\""),
            ("home = \"/site/login}\"", "uses \"}\""),
            ("home = \"/tmp\"", "must contain {login} or {uid}"),
            ("home = \"/nonexistent/site/{login}\"", "/nonexistent/site does not exist on this node"),
            ("home_mode = \"0700\"", "home_mode is set but home is not"),
            ("[[read_only]]\nsource = \"/nonexistent/cvmfs\"", "[[storage.read_only]] source \"/nonexistent/cvmfs\" does not exist on this node"),
            ("[[read_only]]\nsource = \"/srv/{login}\"", "[[storage.read_only]] source \"/srv/{login}\" must be one directory for everybody"),
            ("[[read_write]]\nsource = \"/nonexistent/scratch\"", "[[storage.read_write]] source \"/nonexistent/scratch\" does not exist"),
            ("[[read_write]]\nsource = \"/x/{login}\"\ntarget = \"scratch\"", "[[storage.read_write]] target \"scratch\" must be an absolute path"),
            ("[[read_write]]\nsource = \"/x/{login}\"\ntarget = \"/\"", "the container's root"),
            ("[[read_write]]\nsource = \"/x/{login}\"\ntarget = \"/etc/site\"", "target \"/etc/site\" is a path ongrid or the system needs"),
            ("[[read_write]]\nsource = \"/x/{login}\"\ntarget = \"/run/ongrid/x\"", "ongrid's injected tools"),
            ("[[read_write]]\nsource = \"/x/{login}\"\ntarget = \"/home/{login}\"", "the users' homes"),
            ("[[read_write]]\nsource = \"/x/{login}\"\ntarget = \"/ongrid/work\"", "a batch job's working directory"),
            ("[[read_write]]\nsource = \"/x/{login}\"\ntarget = \"/s\"\npropagation = \"shared\"", "[[storage.read_write]] propagation \"shared\" is not one of"),
        ];
        for (text, expected) in cases {
            let text = text.replace("/tmp", &root);
            let err = parse(&text).expect_err(&text).to_string();
            assert!(err.contains(expected), "{text}: {err}");
        }
        std::fs::create_dir(dir.path().join("a")).unwrap();
        let err = parse(&format!(
            "[[read_only]]\nsource = \"{root}/a\"\ntarget = \"/data\"\n\
             [[read_write]]\nsource = \"/x/{{login}}\"\ntarget = \"/data\"\n"
        ))
        .unwrap_err();
        assert_eq!(
            err,
            StorageError::DuplicateTarget {
                key: RW_TARGET,
                target: "/data".into()
            }
        );
        // A directory inside a home is a fine target.
        parse("[[read_write]]\nsource = \"/x/{login}\"\ntarget = \"/home/{login}/data\"\n")
            .unwrap();
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err =
            toml::from_str::<StorageFile>("[[read_only]]\nsource = \"/cvmfs\"\nmode = \"ro\"\n")
                .unwrap_err();
        assert!(err.to_string().contains("mode"), "{err}");
    }
}
