//! What freezing drops from a session's filesystem: the one documented list ([`STRIP_LIST`]) of
//! things only interactive use needs, and the path matching the tar filter applies to every
//! entry of the export.
//!
//! Patterns are matched against an entry's path relative to the root (`etc/ssh/ssh_host_rsa_key`,
//! no leading `/` or `./`). A pattern names a path; when it matches, that path **and everything
//! under it** is dropped, so `tmp/*` empties `/tmp` but keeps the directory itself. Syntax:
//! `*` matches any run of characters inside one path component, `**` (a whole component) matches
//! any number of components, and a leading `~/` stands for every home directory (`root/` and
//! `home/*/`). Nothing else is special.

/// One rule of the strip list: a pattern and why the path is interactive-only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StripRule {
    pub pattern: &'static str,
    pub reason: &'static str,
}

/// Everything freezing removes, in one place. Each rule says why the frozen (batch) image does
/// not need it. Paths under `/home/<user>` that live on the session's home volume are not in the
/// export at all; the rules for `~/` catch what was written into the container itself.
pub const STRIP_LIST: &[StripRule] = &[
    StripRule {
        pattern: "run/ongrid",
        reason: "ongrid's injected tools (sftp-server and its libraries): the agent adds them to \
                 every dev container and nothing else lives there",
    },
    StripRule {
        pattern: ".dockerenv",
        reason: "Docker's marker file: under Apptainer it would tell programs they run in Docker",
    },
    StripRule {
        pattern: "etc/ssh/ssh_host_*",
        reason: "SSH host keys: private keys must not be shared through an image; sshd makes new \
                 ones where it is needed",
    },
    StripRule {
        pattern: "~/.ssh",
        reason:
            "the user's SSH keys, known_hosts and authorized_keys: credentials must not travel \
                 in an image other people and batch nodes read",
    },
    StripRule {
        pattern: "~/.*_history",
        reason: "command histories (bash, zsh, sh, python, node_repl, psql, mysql, sqlite, ...): \
                 interactive only, and they often hold tokens typed on the command line",
    },
    StripRule {
        pattern: "~/.local/share/fish/fish_history",
        reason: "fish's command history",
    },
    StripRule {
        pattern: "~/.ipython/profile_*/history.sqlite",
        reason: "IPython's command history",
    },
    StripRule {
        pattern: "~/.lesshst",
        reason: "less's search history",
    },
    StripRule {
        pattern: "~/.viminfo",
        reason: "vim's command and search history",
    },
    StripRule {
        pattern: "~/.wget-hsts",
        reason: "wget's HSTS cache from interactive downloads",
    },
    StripRule {
        pattern: "~/.vscode-server",
        reason: "VS Code Remote-SSH's server and extensions: downloaded per connection by the \
                 editor, hundreds of MB, never used by a batch job",
    },
    StripRule {
        pattern: "opt/ongrid/jupyter",
        reason: "JupyterLab of the ongrid dev image (about 240 MB): the notebook server a \
                 session starts for its owner's browser, never run by a batch job; its launcher \
                 stays and tells a session started from the frozen image that it has none",
    },
    StripRule {
        pattern: "~/.cache/pip",
        reason: "pip's download and wheel cache: installed packages are elsewhere",
    },
    StripRule {
        pattern: "~/.npm/_cacache",
        reason: "npm's download cache",
    },
    StripRule {
        pattern: "**/*conda*/pkgs/*.conda",
        reason: "conda's downloaded package archives (what `conda clean --tarballs` removes); the \
                 extracted packages stay because environments hard-link into them",
    },
    StripRule {
        pattern: "**/*conda*/pkgs/*.tar.bz2",
        reason: "conda's downloaded package archives, old format",
    },
    StripRule {
        pattern: "**/*forge*/pkgs/*.conda",
        reason: "miniforge/mambaforge's downloaded package archives",
    },
    StripRule {
        pattern: "**/*forge*/pkgs/*.tar.bz2",
        reason: "miniforge/mambaforge's downloaded package archives, old format",
    },
    StripRule {
        pattern: "**/var/spack/cache",
        reason: "spack's download (source mirror) cache inside a spack installation",
    },
    StripRule {
        pattern: "~/.spack/cache",
        reason: "spack's per-user download and index cache",
    },
    StripRule {
        pattern: "var/cache/apt/archives/*.deb",
        reason: "apt's downloaded packages",
    },
    StripRule {
        pattern: "tmp/*",
        reason: "/tmp contents (including grid proxies x509up_u*): scratch of the interactive \
                 session; the directory itself stays",
    },
    StripRule {
        pattern: "var/tmp/*",
        reason: "/var/tmp contents; the directory itself stays",
    },
    StripRule {
        pattern: ".singularity.d",
        reason: "Apptainer's metadata: freezing writes it anew from the session image's \
                 environment, working directory and entrypoint",
    },
    StripRule {
        pattern: "singularity",
        reason: "Apptainer's runscript link, written anew",
    },
    StripRule {
        pattern: "environment",
        reason: "Apptainer's environment link, written anew",
    },
    StripRule {
        pattern: ".run",
        reason: "Apptainer's action link, written anew",
    },
    StripRule {
        pattern: ".exec",
        reason: "Apptainer's action link, written anew",
    },
    StripRule {
        pattern: ".test",
        reason: "Apptainer's action link, written anew",
    },
    StripRule {
        pattern: ".shell",
        reason: "Apptainer's action link, written anew",
    },
];

/// The first rule of [`STRIP_LIST`] that drops `path` (relative, `/`-separated, no leading `/`).
pub fn strip_rule_for(path: &[u8]) -> Option<&'static StripRule> {
    let components: Vec<&[u8]> = components(path).collect();
    StripMatcher::global().rule_for(&components)
}

/// Whether `pattern` (syntax in the module docs) matches `path` or one of its ancestors.
pub fn pattern_matches(pattern: &str, path: &[u8]) -> bool {
    let path: Vec<&[u8]> = components(path).collect();
    compile(pattern)
        .iter()
        .any(|alternative| matches_components(alternative, &path))
}

/// [`STRIP_LIST`] with its patterns split into components once.
pub(crate) struct StripMatcher {
    rules: Vec<(Vec<Vec<Vec<u8>>>, &'static StripRule)>,
}

impl StripMatcher {
    pub fn global() -> &'static StripMatcher {
        static MATCHER: std::sync::OnceLock<StripMatcher> = std::sync::OnceLock::new();
        MATCHER.get_or_init(|| StripMatcher {
            rules: STRIP_LIST
                .iter()
                .map(|rule| (compile(rule.pattern), rule))
                .collect(),
        })
    }

    /// The first rule that drops the path made of `components`.
    pub fn rule_for(&self, components: &[&[u8]]) -> Option<&'static StripRule> {
        self.rules.iter().find_map(|(alternatives, rule)| {
            alternatives
                .iter()
                .any(|alternative| matches_components(alternative, components))
                .then_some(*rule)
        })
    }
}

/// A pattern as lists of components, one list per alternative (`~/` has two).
fn compile(pattern: &str) -> Vec<Vec<Vec<u8>>> {
    let split =
        |p: &str| -> Vec<Vec<u8>> { components(p.as_bytes()).map(<[u8]>::to_vec).collect() };
    match pattern.strip_prefix("~/") {
        Some(rest) => vec![
            [b"root".to_vec()].into_iter().chain(split(rest)).collect(),
            [b"home".to_vec(), b"*".to_vec()]
                .into_iter()
                .chain(split(rest))
                .collect(),
        ],
        None => vec![split(pattern)],
    }
}

fn matches_components(pattern: &[Vec<u8>], path: &[&[u8]]) -> bool {
    !path.is_empty() && matches_prefix(pattern, path)
}

pub(crate) fn components(path: &[u8]) -> impl Iterator<Item = &[u8]> {
    path.split(|b| *b == b'/').filter(|c| !c.is_empty())
}

/// Whether the pattern components consume a non-empty prefix of the path components.
fn matches_prefix(pattern: &[Vec<u8>], path: &[&[u8]]) -> bool {
    match pattern.split_first() {
        // The whole pattern matched: `path` is the matched path or below it. A pattern made only
        // of `**` never reaches here with an empty match, see below.
        None => true,
        Some((first, rest)) if first.as_slice() == b"**" => {
            // `**` takes zero or more components; at least one component must remain for the
            // rest of the pattern, or the rest must be empty and something consumed overall.
            (0..=path.len()).any(|skip| {
                let remaining = &path[skip..];
                if rest.is_empty() {
                    skip > 0
                } else {
                    matches_prefix(rest, remaining)
                }
            })
        }
        Some((first, rest)) => match path.split_first() {
            Some((component, path_rest)) => {
                component_matches(first, component) && matches_prefix(rest, path_rest)
            }
            None => false,
        },
    }
}

/// Glob match of one component: `*` matches any run of bytes, everything else itself.
fn component_matches(pattern: &[u8], name: &[u8]) -> bool {
    match pattern.iter().position(|b| *b == b'*') {
        None => pattern == name,
        Some(star) => {
            let (head, tail) = (&pattern[..star], &pattern[star + 1..]);
            if !name.starts_with(head) {
                return false;
            }
            let name = &name[head.len()..];
            (0..=name.len()).any(|start| component_matches(tail, &name[start..]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn drops(path: &str) -> bool {
        strip_rule_for(path.as_bytes()).is_some()
    }

    #[test]
    fn the_list_drops_what_it_documents() {
        for path in [
            "run/ongrid",
            "run/ongrid/sftp/sftp-server",
            ".dockerenv",
            "etc/ssh/ssh_host_ed25519_key",
            "etc/ssh/ssh_host_rsa_key.pub",
            "root/.bash_history",
            "home/alice/.bash_history",
            "home/alice/.zsh_history",
            "home/alice/.python_history",
            "root/.ssh/id_ed25519",
            "home/alice/.cache/pip/http-v2/a/b",
            "root/.cache/pip",
            "opt/conda/pkgs/numpy-1.26.4-py311.conda",
            "home/alice/miniconda3/pkgs/zlib-1.2.13-h5eee18b_0.tar.bz2",
            "home/alice/miniforge3/pkgs/python-3.12.conda",
            "opt/spack/var/spack/cache/_source-cache/archive/ab/x.tar.gz",
            "home/alice/.spack/cache/providers",
            "home/alice/.npm/_cacache/index-v5/00",
            "home/alice/.vscode-server/bin/x/node",
            "opt/ongrid/jupyter/bin/jupyter-lab",
            "var/cache/apt/archives/curl_8.deb",
            "tmp/x509up_u1000",
            "tmp/a/b/c",
            "var/tmp/build.log",
            ".singularity.d/runscript",
            "singularity",
            "environment",
        ] {
            assert!(drops(path), "{path} should be stripped");
        }
    }

    #[test]
    fn the_list_keeps_what_batch_jobs_need() {
        for path in [
            "tmp",
            "var/tmp",
            "etc/ssh",
            "etc/ssh/ssh_config",
            "home/alice",
            "home/alice/.bashrc",
            "home/alice/.cache",
            "home/alice/.cache/huggingface/hub/model.safetensors",
            "root/.cache/pipx",
            "opt/conda/pkgs/numpy-1.26.4-py311/lib/x.so",
            "opt/conda/envs/a/lib/python3.11/site-packages/x.py",
            "home/alice/project/pkgs/data.tar.bz2",
            "usr/bin/python3",
            "var/cache/apt/pkgcache.bin",
            "run/ongrid-other",
            "home/alice/tmp/x",
            "srv/tmp/x",
            "home/alice/environment",
            "usr/local/bin/ongrid-jupyter",
            "opt/ongrid/jupyter-notes.txt",
        ] {
            assert!(!drops(path), "{path} should be kept");
        }
    }

    #[test]
    fn patterns_match_globs_per_component() {
        assert!(component_matches(b"*", b""));
        assert!(component_matches(b"ssh_host_*", b"ssh_host_rsa_key"));
        assert!(!component_matches(b"ssh_host_*", b"ssh_config"));
        assert!(component_matches(b"*conda*", b".conda"));
        assert!(component_matches(b"*.tar.bz2", b"x.tar.bz2"));
        assert!(!component_matches(b"*.tar.bz2", b"x.tar.bz2.part"));
        assert!(pattern_matches("**/a", b"a"));
        assert!(pattern_matches("**/a", b"x/y/a/z"));
        assert!(!pattern_matches("**", b""));
        assert!(!pattern_matches("a", b""));
    }

    /// The reference semantics, as a regular expression over the whole path.
    fn reference_regex(pattern: &str) -> regex::bytes::Regex {
        let (prefix, rest) = match pattern.strip_prefix("~/") {
            Some(rest) => ("(?:root|home/[^/]*)/".to_string(), rest),
            None => (String::new(), pattern),
        };
        let mut body = String::new();
        let parts: Vec<&str> = rest.split('/').collect();
        for (i, part) in parts.iter().enumerate() {
            let last = i + 1 == parts.len();
            if *part == "**" {
                body.push_str(if last {
                    "(?:[^/]+/)*[^/]+"
                } else {
                    "(?:[^/]+/)*"
                });
                continue;
            }
            let glob: Vec<String> = part.split('*').map(regex::escape).collect();
            body.push_str(&glob.join("[^/]*"));
            if !last {
                body.push('/');
            }
        }
        regex::bytes::Regex::new(&format!("^{prefix}{body}(?:/.*)?$")).expect("valid regex")
    }

    fn component() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("root".to_string()),
            Just("home".to_string()),
            Just("tmp".to_string()),
            Just(".cache".to_string()),
            Just("pip".to_string()),
            Just("pkgs".to_string()),
            Just("miniconda3".to_string()),
            Just("x.conda".to_string()),
            Just(".bash_history".to_string()),
            Just("ssh_host_rsa_key".to_string()),
            "[a-z._*-]{1,6}",
        ]
    }

    proptest! {
        #[test]
        fn matcher_agrees_with_the_reference(
            parts in proptest::collection::vec(component(), 1..6),
            rule in 0..STRIP_LIST.len(),
        ) {
            let path = parts.join("/");
            let pattern = STRIP_LIST[rule].pattern;
            prop_assert_eq!(
                pattern_matches(pattern, path.as_bytes()),
                reference_regex(pattern).is_match(path.as_bytes()),
                "pattern {} path {}", pattern, path
            );
        }

        #[test]
        fn random_patterns_agree_with_the_reference(
            pattern in proptest::collection::vec(
                prop_oneof![Just("**".to_string()), Just("*".to_string()), "[ab*]{1,3}"], 1..4),
            parts in proptest::collection::vec("[ab]{1,3}", 1..5),
        ) {
            let pattern = pattern.join("/");
            let path = parts.join("/");
            prop_assert_eq!(
                pattern_matches(&pattern, path.as_bytes()),
                reference_regex(&pattern).is_match(path.as_bytes()),
                "pattern {} path {}", pattern, path
            );
        }
    }
}
