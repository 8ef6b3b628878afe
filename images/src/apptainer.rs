//! The Apptainer metadata freezing adds to the root filesystem, so that `apptainer exec/run`
//! behave like the session did: `/.singularity.d/` (environment scripts, action scripts, the
//! runscript from the image's ENTRYPOINT/CMD/WORKDIR, labels), the top-level links Apptainer
//! expects (`/singularity`, `/.run`, `/.exec`, `/.test`, `/.shell`, `/environment`), and the
//! standard directories it mounts over when the export lacks them.
//!
//! The layout follows what Apptainer's own Docker conversion writes (its `base_environment.go`
//! and `conveyorPacker_oci.go`); the script texts are ours.

use std::collections::BTreeMap;

use crate::provenance::{ImageConfig, Provenance};

/// One filesystem object to append after the export's entries (owned by root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Generated {
    Dir {
        path: String,
        mode: u32,
    },
    File {
        path: String,
        mode: u32,
        data: Vec<u8>,
    },
    Symlink {
        path: String,
        target: String,
    },
}

/// Directories Apptainer mounts over or expects; added with these modes when the export has no
/// entry for them. Order matters: parents first.
pub(crate) const STANDARD_DIRS: &[(&str, u32)] = &[
    ("dev", 0o755),
    ("proc", 0o555),
    ("sys", 0o555),
    ("home", 0o755),
    ("root", 0o700),
    ("etc", 0o755),
    ("tmp", 0o1777),
    ("var", 0o755),
    ("var/tmp", 0o1777),
];

/// Sources every environment script in order; shared by the action scripts.
const SOURCE_ENV: &str = "for script in /.singularity.d/env/*.sh; do\n    \
                          if [ -f \"$script\" ]; then\n        . \"$script\"\n    fi\ndone\n";

/// The `/.singularity.d` tree and top-level links for an image with `config`.
pub(crate) fn singularity_tree(config: &ImageConfig, provenance: &Provenance) -> Vec<Generated> {
    let dir = |path: &str| Generated::Dir {
        path: path.to_string(),
        mode: 0o755,
    };
    let script = |path: &str, text: String| Generated::File {
        path: path.to_string(),
        mode: 0o755,
        data: text.into_bytes(),
    };
    let link = |path: &str, target: &str| Generated::Symlink {
        path: path.to_string(),
        target: target.to_string(),
    };
    vec![
        dir(".singularity.d"),
        dir(".singularity.d/env"),
        dir(".singularity.d/actions"),
        dir(".singularity.d/libs"),
        script(".singularity.d/env/01-base.sh", base_env()),
        script(
            ".singularity.d/env/10-docker2singularity.sh",
            docker_env(&config.env),
        ),
        script(".singularity.d/env/90-environment.sh", user_env()),
        script(".singularity.d/env/95-apps.sh", apps_env()),
        script(".singularity.d/env/99-base.sh", final_env()),
        script(".singularity.d/env/99-runtimevars.sh", runtime_vars_env()),
        script(".singularity.d/actions/exec", exec_action()),
        script(".singularity.d/actions/run", run_action()),
        script(".singularity.d/actions/shell", shell_action()),
        script(".singularity.d/actions/start", start_action()),
        script(".singularity.d/actions/test", test_action()),
        script(".singularity.d/runscript", runscript(config)),
        script(".singularity.d/startscript", "#!/bin/sh\n".to_string()),
        Generated::File {
            path: ".singularity.d/labels.json".to_string(),
            mode: 0o644,
            data: labels_json(provenance),
        },
        link("singularity", ".singularity.d/runscript"),
        link(".run", ".singularity.d/actions/run"),
        link(".exec", ".singularity.d/actions/exec"),
        link(".test", ".singularity.d/actions/test"),
        link(".shell", ".singularity.d/actions/shell"),
        link("environment", ".singularity.d/env/90-environment.sh"),
    ]
}

fn base_env() -> String {
    "#!/bin/sh\n# Base environment of an ongrid-frozen image (sourced first by every action).\n"
        .to_string()
}

/// The image's `Env`, as Apptainer's Docker conversion exports it: a value set by the caller
/// wins (`${K:-"v"}`), except `PATH`, which the image always sets.
fn docker_env(env: &[String]) -> String {
    let mut out = String::from(
        "#!/bin/sh\n# The session image's environment (Docker ENV), written by ongrid freeze.\n",
    );
    for entry in env {
        let (name, value) = match entry.split_once('=') {
            Some((name, value)) => (name, Some(value)),
            None => (entry.as_str(), None),
        };
        if !is_variable_name(name) {
            out.push_str(&format!(
                "# skipped, not a shell variable name: {}\n",
                one_line(name)
            ));
            continue;
        }
        match value {
            None => out.push_str(&format!("export {name}=\"${{{name}:-}}\"\n")),
            Some(value) if name == "PATH" => {
                out.push_str(&format!("export PATH=\"{}\"\n", double_quoted(value)));
            }
            Some(value) => out.push_str(&format!(
                "export {name}=\"${{{name}:-\"{}\"}}\"\n",
                double_quoted(value)
            )),
        }
    }
    out
}

fn user_env() -> String {
    "#!/bin/sh\n# Custom environment for this image goes here.\n".to_string()
}

fn apps_env() -> String {
    // SCIF apps: ongrid images have none, but Apptainer's --app option looks here.
    "#!/bin/sh\n\
     if [ -n \"${SINGULARITY_APPNAME:-}\" ]; then\n    \
         if [ -d \"/scif/apps/${SINGULARITY_APPNAME}\" ]; then\n        \
             SCIF_APPS=/scif/apps\n        \
             SCIF_APPROOT=\"/scif/apps/${SINGULARITY_APPNAME}\"\n        \
             PATH=\"$SCIF_APPROOT/bin:$SCIF_APPROOT:$PATH\"\n        \
             export SINGULARITY_APPNAME SCIF_APPS SCIF_APPROOT PATH\n    \
         else\n        \
             echo \"this image has no app named ${SINGULARITY_APPNAME}\" >&2\n        \
             exit 1\n    \
         fi\n\
     fi\n"
        .to_string()
}

fn final_env() -> String {
    "#!/bin/sh\n\
     LD_LIBRARY_PATH=\"${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/.singularity.d/libs\"\n\
     PS1=\"${PS1:-Apptainer> }\"\n\
     export LD_LIBRARY_PATH PS1\n"
        .to_string()
}

fn runtime_vars_env() -> String {
    // Apptainer passes --env PATH changes through these variables.
    "#!/bin/sh\n\
     if [ -n \"${SING_USER_DEFINED_PREPEND_PATH:-}\" ]; then\n    \
         PATH=\"$SING_USER_DEFINED_PREPEND_PATH:$PATH\"\n\
     fi\n\
     if [ -n \"${SING_USER_DEFINED_APPEND_PATH:-}\" ]; then\n    \
         PATH=\"$PATH:$SING_USER_DEFINED_APPEND_PATH\"\n\
     fi\n\
     if [ -n \"${SING_USER_DEFINED_PATH:-}\" ]; then\n    \
         PATH=\"$SING_USER_DEFINED_PATH\"\n\
     fi\n\
     unset SING_USER_DEFINED_PREPEND_PATH SING_USER_DEFINED_APPEND_PATH SING_USER_DEFINED_PATH\n\
     export PATH\n"
        .to_string()
}

fn exec_action() -> String {
    format!("#!/bin/sh\n{SOURCE_ENV}exec \"$@\"\n")
}

fn run_action() -> String {
    format!(
        "#!/bin/sh\n{SOURCE_ENV}\
         if [ -x /.singularity.d/runscript ]; then\n    \
             exec /.singularity.d/runscript \"$@\"\n\
         fi\n\
         echo \"this image has no runscript, running /bin/sh\" >&2\n\
         exec /bin/sh \"$@\"\n"
    )
}

fn shell_action() -> String {
    format!(
        "#!/bin/sh\n{SOURCE_ENV}\
         if [ -n \"${{SINGULARITY_SHELL:-}}\" ] && [ -x \"$SINGULARITY_SHELL\" ]; then\n    \
             exec \"$SINGULARITY_SHELL\" \"$@\"\n\
         fi\n\
         if [ -x /bin/bash ]; then\n    \
             SHELL=/bin/bash\n    \
             PS1=\"Apptainer> \"\n    \
             export SHELL PS1\n    \
             exec /bin/bash --norc \"$@\"\n\
         fi\n\
         SHELL=/bin/sh\n\
         export SHELL\n\
         exec /bin/sh \"$@\"\n"
    )
}

fn start_action() -> String {
    // Apptainer's instance start waits for its PID 1 to be told to continue.
    format!(
        "#!/bin/sh\nkill -CONT 1\n{SOURCE_ENV}\
         if [ -x /.singularity.d/startscript ]; then\n    \
             exec /.singularity.d/startscript\n\
         fi\n"
    )
}

fn test_action() -> String {
    format!(
        "#!/bin/sh\n{SOURCE_ENV}\
         if [ -x /.singularity.d/test ]; then\n    \
             exec /.singularity.d/test \"$@\"\n\
         fi\n\
         exec /bin/sh -c true\n"
    )
}

/// `apptainer run` with Docker's rules: arguments replace CMD, ENTRYPOINT always comes first,
/// the working directory is WORKDIR when it exists. Arguments are passed as they are, never
/// evaluated by the shell.
pub(crate) fn runscript(config: &ImageConfig) -> String {
    let mut out = String::from(
        "#!/bin/sh\n# Written by ongrid freeze from the session image's ENTRYPOINT, CMD and WORKDIR.\n",
    );
    if let Some(dir) = config.working_dir.as_deref().filter(|d| !d.is_empty()) {
        out.push_str(&format!(
            "if [ -d {dir} ]; then\n    cd {dir} || exit 1\nfi\n",
            dir = single_quoted(dir)
        ));
    }
    if config.entrypoint.is_empty() && config.cmd.is_empty() {
        out.push_str(
            "if [ $# -eq 0 ]; then\n    \
                 echo 'this image has no ENTRYPOINT or CMD: use apptainer exec IMAGE COMMAND' >&2\n    \
                 exit 1\n\
             fi\n",
        );
    }
    if !config.cmd.is_empty() {
        out.push_str(&format!(
            "if [ $# -eq 0 ]; then\n    set -- {}\nfi\n",
            words(&config.cmd)
        ));
    }
    if !config.entrypoint.is_empty() {
        out.push_str(&format!("set -- {} \"$@\"\n", words(&config.entrypoint)));
    }
    out.push_str("exec \"$@\"\n");
    out
}

/// Labels Apptainer's `inspect` shows: the provenance of the frozen image.
fn labels_json(provenance: &Provenance) -> Vec<u8> {
    let labels: BTreeMap<&str, String> = [
        ("org.ongrid.owner", provenance.owner.clone()),
        ("org.ongrid.session", provenance.session.clone()),
        ("org.ongrid.base-image", provenance.base_image.clone()),
        ("org.ongrid.reference", provenance.reference.clone()),
        ("org.ongrid.created", provenance.created_at.to_rfc3339()),
    ]
    .into_iter()
    .collect();
    let mut json = serde_json::to_vec_pretty(&labels).unwrap_or_else(|_| b"{}".to_vec());
    json.push(b'\n');
    json
}

fn is_variable_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Escapes text for the inside of a double-quoted shell string.
fn double_quoted(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        if matches!(c, '\\' | '"' | '$' | '`') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A single-quoted shell word.
fn single_quoted(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

fn words(args: &[String]) -> String {
    args.iter()
        .map(|a| single_quoted(a))
        .collect::<Vec<_>>()
        .join(" ")
}

fn one_line(text: &str) -> String {
    text.chars().filter(|c| !c.is_control()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn config(entrypoint: &[&str], cmd: &[&str]) -> ImageConfig {
        ImageConfig {
            env: vec![],
            working_dir: None,
            entrypoint: entrypoint.iter().map(|s| s.to_string()).collect(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            user: None,
        }
    }

    /// Runs the runscript with /bin/sh, `exec` replaced by printing the final argv.
    fn run(script: &str, args: &[&str]) -> String {
        let script = script.replace("exec \"$@\"", "printf '[%s]' \"$@\"");
        let out = Command::new("/bin/sh")
            .arg("-c")
            .arg(script)
            .arg("runscript")
            .args(args)
            .output()
            .expect("sh runs");
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    }

    #[test]
    fn runscript_follows_docker_rules() {
        let both = runscript(&config(&["/bin/entry", "--flag"], &["default", "it's"]));
        assert_eq!(run(&both, &[]), "[/bin/entry][--flag][default][it's]");
        assert_eq!(
            run(&both, &["a b", "$HOME"]),
            "[/bin/entry][--flag][a b][$HOME]"
        );
        let cmd_only = runscript(&config(&[], &["python3", "-V"]));
        assert_eq!(run(&cmd_only, &[]), "[python3][-V]");
        assert_eq!(run(&cmd_only, &["ls", "*"]), "[ls][*]");
        let entry_only = runscript(&config(&["/e"], &[]));
        assert_eq!(run(&entry_only, &["x"]), "[/e][x]");
        let neither = runscript(&config(&[], &[]));
        assert!(run(&neither, &[]).contains("no ENTRYPOINT or CMD"));
        assert_eq!(run(&neither, &["true"]), "[true]");
    }

    #[test]
    fn runscript_enters_the_working_directory() {
        let mut cfg = config(&[], &["pwd"]);
        cfg.working_dir = Some("/".to_string());
        let script = runscript(&cfg).replace("exec \"$@\"", "pwd");
        let out = Command::new("/bin/sh")
            .arg("-c")
            .arg(script)
            .current_dir(std::env::temp_dir())
            .output()
            .expect("sh runs");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "/\n");
    }

    #[test]
    fn env_script_keeps_caller_values_except_path() {
        let script = docker_env(&[
            "PATH=/opt/bin:/usr/bin".to_string(),
            "LANG=C.UTF-8".to_string(),
            "TRICKY=a \"b\" $c `d` \\e".to_string(),
            "EMPTY".to_string(),
            "not-a-name=x".to_string(),
        ]);
        assert!(!script.contains("export not-a-name"));
        let out = Command::new("/bin/sh")
            .arg("-c")
            .arg(format!(
                "{script}\nprintf '%s|%s|%s|%s' \"$PATH\" \"$LANG\" \"$TRICKY\" \"${{EMPTY-unset}}\""
            ))
            .env("LANG", "de_DE.UTF-8")
            .env("PATH", "/host/bin")
            .env_remove("EMPTY")
            .output()
            .expect("sh runs");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "/opt/bin:/usr/bin|de_DE.UTF-8|a \"b\" $c `d` \\e|"
        );
    }
}
