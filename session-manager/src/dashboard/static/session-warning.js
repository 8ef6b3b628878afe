// Put by the manager into JupyterLab's pages of a session: asks every minute what the session's
// owner should know (a hold coming within the site's warning time, or that the session is held)
// and shows it in a bar at the bottom of the page, above JupyterLab's status bar. "Dismiss"
// hides a text until it changes. Its requests are reads, so they never count as activity.
(() => {
  "use strict";
  const session = document.currentScript.dataset.session;
  const bar = document.createElement("div");
  bar.id = "ongrid-session-warning";
  bar.setAttribute("role", "alert");
  bar.hidden = true;
  bar.style.cssText =
    "position:fixed;bottom:24px;left:0;right:0;z-index:100000;padding:6px 12px;" +
    "background:#8a3b00;color:#fff;font:14px/1.4 sans-serif;text-align:center";
  const text = document.createElement("span");
  const dismiss = document.createElement("button");
  dismiss.type = "button";
  dismiss.textContent = "Dismiss";
  dismiss.style.cssText = "margin-left:1em";
  bar.append(text, dismiss);
  let dismissed = "";
  dismiss.addEventListener("click", () => {
    dismissed = text.textContent;
    bar.hidden = true;
  });
  const show = () => document.body.appendChild(bar);
  if (document.body) show(); else document.addEventListener("DOMContentLoaded", show);
  const check = async () => {
    try {
      const answer = await fetch(`/dashboard/sessions/${session}/apps/warning`, {
        credentials: "same-origin",
      });
      if (!answer.ok) return;
      const { warning } = await answer.json();
      text.textContent = warning || "";
      bar.hidden = !warning || warning === dismissed;
    } catch (error) {
      // The manager is out of reach for now; the next check tells.
    }
  };
  check();
  setInterval(check, 60000);
})();
