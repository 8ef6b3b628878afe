//! How `devctl freeze` shows its progress while it waits. On a terminal: an indicatif bar on
//! stderr, redrawn in place, with the bytes of the container's filesystem read, of the
//! estimated total, the rate and the time left. Elsewhere (a log file, CI): a plain line every
//! few seconds, since a redrawn bar would fill a log with control characters. With `--json`:
//! nothing. The rate comes from indicatif's estimator in every case.

use std::io::Write;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use ongrid_core::image::ImageProgress;

use crate::format::format_bytes;

/// The bar while the total is known: `[#####---]  45%  1.20 GiB / 2.60 GiB  85.00 MiB/s  17s left`.
const BAR_TEMPLATE: &str = "[{bar:30}] {percent:>3}%  {binary_bytes} / {binary_total_bytes}  \
                            {binary_bytes_per_sec}  {eta} left";
/// Before the agent has estimated the total: `1.20 GiB read  85.00 MiB/s`.
const COUNT_TEMPLATE: &str = "{binary_bytes} read  {binary_bytes_per_sec}";

/// The progress display of one freeze.
pub struct Progress {
    /// Drawn on a terminal; hidden otherwise, and then only its estimator is used.
    bar: ProgressBar,
    /// Plain lines: how often, and when the last was written.
    lines: Option<Lines>,
    /// Whether the bar currently has a total (the style follows).
    has_total: Option<bool>,
    /// When the wait began: plain lines give a rate once a second of it has passed.
    started: Instant,
}

struct Lines {
    every: Duration,
    last: Option<Instant>,
}

impl Progress {
    /// A bar drawn to `target` (`ProgressDrawTarget::stderr()` on a terminal).
    pub fn bar(target: ProgressDrawTarget) -> Self {
        Self::new(target, None)
    }

    /// A plain line to the notes at most every `every`.
    pub fn lines(every: Duration) -> Self {
        Self::new(
            ProgressDrawTarget::hidden(),
            Some(Lines { every, last: None }),
        )
    }

    /// Nothing shown (`--json`).
    pub fn silent() -> Self {
        Self::new(ProgressDrawTarget::hidden(), None)
    }

    fn new(target: ProgressDrawTarget, lines: Option<Lines>) -> Self {
        Self {
            bar: ProgressBar::with_draw_target(None, target),
            lines,
            has_total: None,
            started: Instant::now(),
        }
    }

    /// Shows what the manager reported at `now`; a plain line, when due, goes to `note`.
    pub fn update(&mut self, progress: ImageProgress, now: Instant, note: &mut dyn Write) {
        let has_total = progress.bytes_total > 0;
        if self.has_total != Some(has_total) {
            self.bar.set_style(style(has_total));
            self.has_total = Some(has_total);
        }
        if has_total {
            self.bar.set_length(progress.bytes_total);
        } else {
            self.bar.unset_length();
        }
        self.bar.set_position(progress.bytes_done);
        let Some(lines) = &mut self.lines else {
            return;
        };
        if lines
            .last
            .is_some_and(|at| now.duration_since(at) < lines.every)
        {
            return;
        }
        lines.last = Some(now);
        // A rate over less than a second says nothing.
        let rate = (now.saturating_duration_since(self.started) >= Duration::from_secs(1))
            .then(|| self.bar.per_sec());
        let line = progress_line(progress.bytes_done, progress.bytes_total, rate);
        let _ = writeln!(note, "{line}");
    }

    /// Leaves the bar on the screen as last drawn (a failed freeze does not reach 100 %).
    pub fn finish(&self) {
        self.bar.abandon();
    }
}

fn style(has_total: bool) -> ProgressStyle {
    let template = if has_total {
        BAR_TEMPLATE
    } else {
        COUNT_TEMPLATE
    };
    // The templates are constants checked by the tests; the default style is only a fallback.
    ProgressStyle::with_template(template)
        .map(|style| style.progress_chars("#-"))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
}

/// `[#########-----------]  45%  1.2 GiB / 2.6 GiB  85.0 MiB/s`; without a total (unknown),
/// only the bytes and the rate. Used for plain progress lines and by `devctl image show`.
pub fn progress_line(bytes_done: u64, bytes_total: u64, rate: Option<f64>) -> String {
    const WIDTH: u64 = 30;
    let rate = rate.map_or_else(String::new, |r| {
        format!("  {}/s", format_bytes(r.max(0.0) as u64))
    });
    if bytes_total == 0 {
        return format!("{} read{rate}", format_bytes(bytes_done));
    }
    // The estimate can be short of the real size: never past 100 %.
    let done = bytes_done.min(bytes_total);
    let filled = done * WIDTH / bytes_total;
    let percent = done * 100 / bytes_total;
    format!(
        "[{}{}] {percent:>3}%  {} / {}{rate}",
        "#".repeat(filled as usize),
        "-".repeat((WIDTH - filled) as usize),
        format_bytes(bytes_done),
        format_bytes(bytes_total),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use indicatif::InMemoryTerm;

    fn progress(done: u64, total: u64) -> ImageProgress {
        ImageProgress {
            bytes_done: done,
            bytes_total: total,
        }
    }

    #[test]
    fn templates_parse() {
        assert!(ProgressStyle::with_template(BAR_TEMPLATE).is_ok());
        assert!(ProgressStyle::with_template(COUNT_TEMPLATE).is_ok());
    }

    #[test]
    fn the_bar_shows_fraction_rate_and_time_left() {
        let term = InMemoryTerm::new(4, 120);
        let mut shown = Progress::bar(ProgressDrawTarget::term_like(Box::new(term.clone())));
        let mut note = Vec::new();
        let t0 = Instant::now();
        shown.update(progress(0, 0), t0, &mut note);
        shown.update(progress(2048, 0), t0, &mut note);
        shown.finish();
        assert!(
            term.contents().starts_with("2.00 KiB read  "),
            "{}",
            term.contents()
        );
        shown.update(progress(512 << 20, 1 << 30), t0, &mut note);
        shown.finish();
        let screen = term.contents();
        assert!(
            screen.starts_with("[###############---------------]  50%  512.00 MiB / 1.00 GiB  "),
            "{screen}"
        );
        assert!(screen.trim_end().ends_with(" left"), "{screen}");
        assert!(note.is_empty(), "a bar writes no lines");
    }

    #[test]
    fn plain_lines_come_every_few_seconds() {
        let mut shown = Progress::lines(Duration::from_secs(5));
        let mut note = Vec::new();
        let t0 = Instant::now();
        for (secs, done) in [(0, 0), (2, 20), (4, 40), (5, 50), (9, 90), (10, 100)] {
            shown.update(
                progress(done << 20, 100 << 20),
                t0 + Duration::from_secs(secs),
                &mut note,
            );
        }
        let text = String::from_utf8(note).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(
            lines[0],
            "[------------------------------]   0%  0 B / 100.0 MiB"
        );
        assert!(
            lines[1].starts_with("[###############---------------]  50%  50.0 MiB / 100.0 MiB  "),
            "a rate after the first second: {text}"
        );
        assert!(lines[1].ends_with("/s"), "{text}");
        assert!(
            lines[2].starts_with("[##############################] 100%"),
            "{text}"
        );
    }

    #[test]
    fn silent_progress_writes_nothing() {
        let mut shown = Progress::silent();
        let mut note = Vec::new();
        shown.update(progress(1, 2), Instant::now(), &mut note);
        assert!(note.is_empty());
    }

    #[test]
    fn progress_line_shows_fraction_and_rate() {
        let line = progress_line(512 << 20, 1 << 30, Some((85 << 20) as f64));
        assert_eq!(
            line,
            "[###############---------------]  50%  512.0 MiB / 1.0 GiB  85.0 MiB/s"
        );
        // An estimate short of the truth stops at 100 %.
        assert!(progress_line(3 << 30, 1 << 30, None)
            .starts_with(&format!("[{}] 100%", "#".repeat(30))));
        assert_eq!(progress_line(2048, 0, None), "2.0 KiB read");
    }
}
