//! Where commands write, and how: results to `out` (stdout), as text for people or as the API's
//! JSON with `--json`; notes for the person at the terminal (a queue position, the key file
//! used, progress) to `note` (stderr), so `--json` output stays parseable.

use std::io::{IsTerminal, Write};

use anyhow::Context as _;
use clap::Args;
use serde::Serialize;

/// `--json`, shared by every command that prints a result.
#[derive(Debug, Clone, Copy, Default, Args)]
pub struct JsonArgs {
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

/// The two output streams, and what is known about the screen behind them.
pub struct Terminal<'a> {
    pub out: &'a mut dyn Write,
    pub note: &'a mut dyn Write,
    /// The width of the terminal `out` writes to, or `None` when it is not a terminal (a pipe
    /// or a file): then tables never wrap.
    pub width: Option<u16>,
    /// Whether `note` is a terminal: progress bars are drawn only there.
    pub note_is_terminal: bool,
}

impl<'a> Terminal<'a> {
    /// The process's stdout and stderr, as they are attached.
    pub fn process(out: &'a mut std::io::Stdout, note: &'a mut std::io::Stderr) -> Self {
        let width = console::Term::stdout()
            .size_checked()
            .map(|(_rows, columns)| columns);
        let note_is_terminal = note.is_terminal();
        Self {
            out,
            note,
            width,
            note_is_terminal,
        }
    }

    /// Plain buffers, as tests and pipes see them: no terminal, no wrapping.
    pub fn buffers(out: &'a mut dyn Write, note: &'a mut dyn Write) -> Self {
        Self {
            out,
            note,
            width: None,
            note_is_terminal: false,
        }
    }

    /// Writes a result.
    pub fn print(&mut self, text: &str) -> anyhow::Result<()> {
        self.out
            .write_all(text.as_bytes())
            .and_then(|()| self.out.flush())
            .context("writing to standard output")
    }

    /// Writes a result as pretty-printed JSON.
    pub fn json<T: Serialize + ?Sized>(&mut self, value: &T) -> anyhow::Result<()> {
        let mut text = serde_json::to_string_pretty(value).context("encoding JSON")?;
        text.push('\n');
        self.print(&text)
    }

    /// Writes `value` as JSON when `json`, else the text `render` makes of it.
    pub fn show<T: Serialize + ?Sized>(
        &mut self,
        json: bool,
        value: &T,
        render: impl FnOnce(&T) -> String,
    ) -> anyhow::Result<()> {
        if json {
            self.json(value)
        } else {
            self.print(&render(value))
        }
    }

    /// Writes a note on its own line.
    pub fn note(&mut self, text: &str) {
        // A note that cannot be written (stderr closed) is not worth failing the command for.
        let _ = writeln!(self.note, "{text}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn show_prints_json_or_text() {
        let (mut out, mut note) = (Vec::new(), Vec::new());
        let mut term = Terminal::buffers(&mut out, &mut note);
        term.show(true, &[1, 2], |_| "text\n".to_owned()).unwrap();
        term.show(false, &[1, 2], |v| format!("{} numbers\n", v.len()))
            .unwrap();
        term.note("a note");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[\n  1,\n  2\n]\n2 numbers\n"
        );
        assert_eq!(String::from_utf8(note).unwrap(), "a note\n");
    }
}
