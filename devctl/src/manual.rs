//! What devctl says about itself without a manager or a credential: shell completions and man
//! pages, both generated from the clap definition (`crate::cli::Cli`, handed in as its
//! [`clap::Command`]) so that they never drift from the commands they describe. The packages
//! install both (`deploy/packages/build.sh`).

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use clap_complete::Shell;

use crate::terminal::Terminal;

/// `devctl completions SHELL`.
#[derive(Debug, Clone, Args)]
pub struct CompletionsArgs {
    /// The shell to complete in: bash, zsh or fish (also elvish and powershell)
    pub shell: Shell,
}

/// `devctl manpages DIR`.
#[derive(Debug, Clone, Args)]
pub struct ManpagesArgs {
    /// Directory to write devctl.1 and one page per command (devctl-session-new.1, ...) into;
    /// made when it does not exist
    pub dir: PathBuf,
}

/// Prints the completion script of `args.shell` for `command` (devctl's), to be sourced by that
/// shell.
pub fn completions(
    args: &CompletionsArgs,
    mut command: clap::Command,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, "devctl", &mut script);
    term.out
        .write_all(&script)
        .and_then(|()| term.out.flush())
        .context("writing to standard output")
}

/// Writes the man pages of `command` (devctl's) into `args.dir`, and names each page written.
pub fn manpages(
    args: &ManpagesArgs,
    command: clap::Command,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    let dir = &args.dir;
    std::fs::create_dir_all(dir).with_context(|| {
        format!(
            "cannot make {}: choose a directory you may write",
            dir.display()
        )
    })?;
    clap_mangen::generate_to(command, dir)
        .with_context(|| format!("cannot write the man pages into {}", dir.display()))?;
    let mut pages = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.file_name()))
        .filter_map(|name| name.into_string().ok())
        .filter(|name| name.starts_with("devctl") && name.ends_with(".1"))
        .collect::<Vec<_>>();
    pages.sort();
    term.print(&format!(
        "{} man pages in {}: {}\n",
        pages.len(),
        dir.display(),
        pages.join(" ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;
    use clap::CommandFactory;

    fn run(f: impl FnOnce(&mut Terminal<'_>) -> anyhow::Result<()>) -> String {
        let (mut out, mut note) = (Vec::new(), Vec::new());
        f(&mut Terminal::buffers(&mut out, &mut note)).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn bash_completion_completes_commands_and_their_flags() {
        let script = run(|term| {
            completions(
                &CompletionsArgs { shell: Shell::Bash },
                Cli::command(),
                term,
            )
        });
        assert!(script.contains("complete -F _devctl"), "{script}");
        // Subcommands two levels down, and their flags, come from the clap definition.
        for word in ["session", "admin", "institute", "--share", "--manager-url"] {
            assert!(
                script.contains(word),
                "{word} missing from the bash completion"
            );
        }
    }

    #[test]
    fn zsh_and_fish_completions_name_the_commands() {
        let zsh =
            run(|term| completions(&CompletionsArgs { shell: Shell::Zsh }, Cli::command(), term));
        assert!(zsh.starts_with("#compdef devctl"), "{zsh}");
        let fish = run(|term| {
            completions(
                &CompletionsArgs { shell: Shell::Fish },
                Cli::command(),
                term,
            )
        });
        assert!(fish.contains("complete -c devctl"), "{fish}");
        assert!(fish.contains("session"), "{fish}");
    }

    #[test]
    fn man_pages_cover_every_command() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("man1");
        let printed = run(|term| {
            manpages(
                &ManpagesArgs {
                    dir: target.clone(),
                },
                Cli::command(),
                term,
            )
        });
        for page in [
            "devctl.1",
            "devctl-session-new.1",
            "devctl-admin-institute-add.1",
        ] {
            let text = std::fs::read_to_string(target.join(page))
                .unwrap_or_else(|err| panic!("{page}: {err}; printed: {printed}"));
            assert!(text.starts_with(".ie"), "{page} is not roff: {text}");
            assert!(printed.contains(page), "{printed}");
        }
        let session_new = std::fs::read_to_string(target.join("devctl-session-new.1")).unwrap();
        assert!(session_new.contains("min\\-capability"), "{session_new}");
        // The hidden command that writes the pages has none of its own.
        assert!(!target.join("devctl-manpages.1").exists());
    }

    #[test]
    fn man_pages_into_a_file_say_what_to_do() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let (mut out, mut note) = (Vec::new(), Vec::new());
        let err = manpages(
            &ManpagesArgs {
                dir: file.path().to_path_buf(),
            },
            Cli::command(),
            &mut Terminal::buffers(&mut out, &mut note),
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("choose a directory"), "{err:#}");
    }
}
