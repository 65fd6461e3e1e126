// Runs before the page paints: apply the saved theme so a dark page never flashes light.
try {
  const theme = JSON.parse(localStorage.getItem('qwick.settings') || '{}').theme;
  if (theme === 'light' || theme === 'dark') document.documentElement.dataset.theme = theme;
} catch {
  // no saved settings: the stylesheet follows the system's preference
}
